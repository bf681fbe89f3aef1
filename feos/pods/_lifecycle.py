"""The pod's life as a table: (state, event) -> the next state. An unknown pair is refused.

Events are what happens to a pod: the calls that change it (create, start, stop, suspend, resume,
delete) and what its microVM does (up: the bring-up ended with every container started; failed:
it did not; crashed, stopped, suspended: the microVM did, without the pod asking).
"""

from __future__ import annotations

from ..errors import Code, FeosError

PENDING, RUNNING, STOPPED, FAILED, SUSPENDED, HIBERNATED = (
    "pending", "running", "stopped", "failed", "suspended", "hibernated")

TABLE: dict[tuple[str, str], str] = {
    (PENDING, "up"): RUNNING,
    (PENDING, "failed"): FAILED,
    (PENDING, "stop"): STOPPED,
    (PENDING, "crashed"): FAILED,
    (PENDING, "stopped"): FAILED,
    (RUNNING, "stop"): STOPPED,
    (RUNNING, "crashed"): FAILED,
    (RUNNING, "stopped"): STOPPED,
    (RUNNING, "suspend"): SUSPENDED,
    (RUNNING, "suspended"): SUSPENDED,
    (RUNNING, "start"): RUNNING,
    (STOPPED, "start"): PENDING,
    (STOPPED, "stop"): STOPPED,
    (FAILED, "start"): PENDING,
    (FAILED, "stop"): STOPPED,
    (SUSPENDED, "resume"): RUNNING,
    (SUSPENDED, "suspend"): SUSPENDED,
    (SUSPENDED, "stop"): STOPPED,
    (RUNNING, "resume"): RUNNING,
}

WHY_NOT = {
    "suspend": "only a running pod can be suspended",
    "resume": "only a suspended pod can be resumed",
    "start": "only a stopped or failed pod can be started",
}


def next_state(state: str, event: str, pod_id: str = "") -> str:
    """The state after event; FAILED_PRECONDITION for a call the state does not allow."""
    try:
        return TABLE[(state, event)]
    except KeyError:
        why = WHY_NOT.get(event, f"{event} does not apply")
        raise FeosError(Code.FAILED_PRECONDITION, f"pod {pod_id} is {state}: {why}") from None
