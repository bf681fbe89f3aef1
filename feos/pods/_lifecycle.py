"""The pod's life as a table: (state, event) -> the next state. An unknown pair is refused.

Every state a pod takes is looked up here, by the pod service's one `_apply`: no code sets a
state by hand. Events are what happens to a pod:

- the calls that change it: create, start, stop, suspend, resume, delete;
- a hibernation's end (hibernate: its checkpoint is in the object store and the record names
  it) and a restore's middle (restore: the checkpoint's disks, and its memory if it has any,
  are on the node again: SUSPENDED or STOPPED, which a resume or a start then ends), and the
  take-over of a checkpoint made elsewhere (take: ABSENT to HIBERNATED, feos.pods._hibernate);
- the bring-up's end: up (every container started) or failed (it did not, or its time ran out);
- what its microVM did on its own while the pod ran: crashed, stopped, suspended (the microVM
  layer's events; in any other state the change that holds the pod's lock made them itself);
- what a feosd that starts again finds of a kept pod's microVM (take-over): found-gone,
  found-crashed, found-stopped, found-suspended, found-running.

A transition to the state the pod is in changes nothing: no record, no event (a start of a
running pod, a stop of a stopped one). ABSENT is the state before a create; DELETED the one after
a delete: neither is ever recorded.
"""

from __future__ import annotations

from ..errors import Code, FeosError

PENDING, RUNNING, STOPPED, FAILED, SUSPENDED, HIBERNATED = (
    "pending", "running", "stopped", "failed", "suspended", "hibernated")
ABSENT, DELETED = "absent", "deleted"

VM_EVENTS = ("crashed", "stopped", "suspended")
"""The microVM's own events: they apply to a RUNNING pod only."""

TABLE: dict[tuple[str, str], str] = {
    (ABSENT, "create"): PENDING,
    # the bring-up
    (PENDING, "up"): RUNNING,
    (PENDING, "failed"): FAILED,
    (PENDING, "stop"): STOPPED,  # a stop ends the bring-up first
    (PENDING, "start"): PENDING,
    # the calls
    (RUNNING, "start"): RUNNING,
    (RUNNING, "stop"): STOPPED,
    (RUNNING, "suspend"): SUSPENDED,
    (RUNNING, "resume"): RUNNING,
    (STOPPED, "start"): PENDING,
    (STOPPED, "stop"): STOPPED,
    (FAILED, "start"): PENDING,
    (FAILED, "stop"): STOPPED,
    (SUSPENDED, "resume"): RUNNING,
    (SUSPENDED, "suspend"): SUSPENDED,
    (SUSPENDED, "stop"): STOPPED,
    # hibernation and restore (feos.pods._hibernate)
    (SUSPENDED, "hibernate"): HIBERNATED,
    (STOPPED, "hibernate"): HIBERNATED,
    (HIBERNATED, "hibernate"): HIBERNATED,
    (HIBERNATED, "restore-memory"): SUSPENDED,
    (HIBERNATED, "restore-disks"): STOPPED,
    (ABSENT, "take"): HIBERNATED,
    # the microVM on its own
    (RUNNING, "crashed"): FAILED,
    (RUNNING, "stopped"): STOPPED,  # the guest shut itself down
    (RUNNING, "suspended"): SUSPENDED,
    # a restart finds the microVM of a pod that ran
    (RUNNING, "found-running"): RUNNING,
    (RUNNING, "found-gone"): FAILED,  # its record is gone: nothing to run it on
    (RUNNING, "found-crashed"): FAILED,  # it ended, or was made and never ran
    (RUNNING, "found-stopped"): STOPPED,
    (RUNNING, "found-suspended"): SUSPENDED,  # a suspend cut between the microVM's and ours
    (SUSPENDED, "found-suspended"): SUSPENDED,
    (SUSPENDED, "found-running"): RUNNING,  # a resume cut between the microVM's and ours
}
for _state in (PENDING, RUNNING, STOPPED, FAILED, SUSPENDED, HIBERNATED):
    TABLE[(_state, "delete")] = DELETED  # a delete ends whatever the pod is doing

WHY_NOT = {
    "suspend": "only a running pod can be suspended",
    "resume": "only a suspended or hibernated pod can be resumed",
    "hibernate": "only a running, suspended or stopped pod can be hibernated",
    "start": "only a stopped or failed pod can be started",
}


def next_state(state: str, event: str, pod_id: str = "") -> str:
    """The state after event; FAILED_PRECONDITION for a call the state does not allow."""
    try:
        return TABLE[(state, event)]
    except KeyError:
        why = WHY_NOT.get(event, f"{event} does not apply")
        raise FeosError(Code.FAILED_PRECONDITION, f"pod {pod_id} is {state}: {why}") from None


def allows(state: str, event: str) -> bool:
    return (state, event) in TABLE
