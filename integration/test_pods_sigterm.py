"""feosd's stop in the middle of pod changes: SIGTERM a real feosd during a DeletePod and during a
CreatePod's bring-up, start it again, and check each pod's state.

The stop refuses new changes and lets those in flight run to their ends (within --stop-grace)
before it exits: a delete that was under way is done (the pod stays deleted, no FAILED ghost of
it comes back), and a bring-up that was under way ends RUNNING before feosd exits, so the next
feosd takes the pod over running. One feosd for the module, pods without a network (no
containers: they boot fastest), two guest boots in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from feosd_proc import BIN, Feosd, end_microvms

SPEC = {"network": {"none": None}, "memoryMib": 256}
DELETED, CREATED = "sd0000000dd", "sc0000000cc"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feosd]:
    daemon = Feosd(tmp_path_factory.mktemp("podstop"), "--stop-grace", "120")
    (daemon.root / "spec.json").parent.mkdir(parents=True, exist_ok=True)
    (daemon.root / "spec.json").write_text(json.dumps(SPEC))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop(120)
        end_microvms(daemon.state_dir)


def serving(node: Feosd) -> Feosd:
    """The module's feosd, started again if a test before ended it and failed before its start."""
    assert node.proc is not None
    if node.proc.poll() is not None:
        node.start()
    return node


def qemu_pid(node: Feosd, pod_id: str) -> int:
    pidfile = node.state_dir / "vms" / "qemu" / pod_id / "qemu.pid"
    return int(pidfile.read_text().split()[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = f"/proc/{pid}/status"
    try:
        with open(status) as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def ctl_popen(node: Feosd, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "feosctl"), "--socket", str(node.socket), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_delete_cut_by_sigterm_is_done_and_stays_done(node: Feosd) -> None:
    serving(node)
    node.ctl("pod", "create", DELETED, "-f", str(node.root / "spec.json"), "--wait",
             timeout=180)
    pid = qemu_pid(node, DELETED)
    caller = ctl_popen(node, "pod", "delete", DELETED)
    deadline = time.monotonic() + 60
    while alive(pid):  # the delete is under way once it has ended the microVM
        assert time.monotonic() < deadline, "the delete did not end the microVM"
        time.sleep(0.001)
    assert node.stop(120) == 0
    out, err = caller.communicate(60)
    assert caller.returncode == 0, err  # answered, not cut
    assert out.strip() == f"pod {DELETED} deleted"
    assert not (node.state_dir / "pods" / f"{DELETED}.pb").exists()
    node.start()
    gone = node.ctl("pod", "get", DELETED, check=False)
    assert gone.returncode == 15, gone.stdout  # NOT_FOUND, not a FAILED ghost
    assert not (node.state_dir / "vms" / "qemu" / DELETED).exists()


def test_a_bring_up_cut_by_sigterm_ends_before_feosd_and_is_taken_over(node: Feosd) -> None:
    serving(node)
    node.ctl("pod", "create", CREATED, "-f", str(node.root / "spec.json"))
    deadline = time.monotonic() + 120
    while node.ctl_json("pod", "get", CREATED).get("step") != "guest":
        assert time.monotonic() < deadline, "the bring-up did not reach its guest step"
        time.sleep(0.05)
    pid = qemu_pid(node, CREATED)
    assert node.stop(120) == 0  # the bring-up runs to its end first
    assert "the stop's grace is over" not in node.log_text()
    node.start()
    pod = node.ctl_json("pod", "get", CREATED)  # as the take-over found it, before any bring-up
    assert pod["state"] == "running", pod
    assert pod["reason"] == ""
    assert qemu_pid(node, CREATED) == pid and alive(pid)  # the same microVM, taken over
    node.ctl("pod", "delete", CREATED)
