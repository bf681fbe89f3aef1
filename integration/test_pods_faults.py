"""Pods through faults: callers that go away, kill -9 of feosd, a stop that suspends, races.

One node for the module (podnet.PodNet, feosd with --suspend-on-stop). Pod F1 runs a shell that
holds a token and a counter in its memory; the tests share it (the fixture f1 makes it, or
brings it back to running, for each test that needs it, so each also passes alone); F2 and F3
are cut off in their bring-up by a kill -9 of feosd. Three guest boots in all, in order.

After each kill -9 a new feosd takes the node over: a pod ends in the state the calls it
answered imply, and a pod that is gone leaves no microVM, disk, TAP or record behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from feosd_proc import records_gone, running_pod
from podnet import IMAGE, PodNet

F1, F2, F3 = "fa0000000aa", "fb0000000bb", "fc0000000cc"
LOOP = ("t=$(cat /proc/sys/kernel/random/uuid); n=0; "
        "while :; do n=$((n+1)); echo \"$t $n\" > /tmp/n; sleep 0.2; done")
CREATE = ("--memory", "256MiB", "--image", IMAGE, "--cmd", "/bin/sh", "-c", LOOP)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodNet]:
    with PodNet(tmp_path_factory.mktemp("podfaults"), "--suspend-on-stop",
                "--stop-grace", "120") as node:
        yield node


@pytest.fixture
def f1(net: PodNet) -> str:
    """F1 running its shell, made by the first test that needs it."""
    running_pod(net, F1, *CREATE)
    return F1


def token_and_count(net: PodNet, pod_id: str) -> tuple[str, int]:
    token, count = net.exec(pod_id, "cat", "/tmp/n").stdout.split()
    return token, int(count)


def wait_for(what: str, check: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout}s: {what}")


def step_of(net: PodNet, pod_id: str) -> tuple[str, str]:
    done = net.ctl("--json", "pod", "get", pod_id, check=False)
    if done.returncode:
        return "", ""
    pod = json.loads(done.stdout)
    return pod["state"], pod.get("step", "")


def assert_gone(net: PodNet, pod_id: str) -> None:
    assert net.ctl("pod", "get", pod_id, check=False).returncode == 15
    assert pod_id not in net.qemus()
    assert f"pod-{pod_id}" not in net.links()
    assert records_gone(net.state_dir / "pods", f"{pod_id}.pb")
    assert not (net.state_dir / "disk" / "disks" / pod_id).exists()
    assert not (net.state_dir / "vms" / "qemu" / pod_id).exists()


def test_a_caller_that_goes_away_mid_create_leaves_the_bring_up_going(net: PodNet) -> None:
    caller = net.ctl_popen("pod", "create", F1, "--wait", *CREATE)
    wait_for("the pod being brought up", lambda: step_of(net, F1)[1] in ("vm", "guest"))
    caller.kill()  # as a Ctrl-C of a user's feosctl --wait
    caller.communicate()
    pod = net.wait_state(F1, "running")
    assert pod["reason"] == ""
    assert net.exec(F1, "echo", "hi").stdout == "hi\n"


def test_running_microvms_are_taken_over_across_a_kill_9(net: PodNet, f1: str) -> None:
    pid = net.qemus()[F1]
    token, before = token_and_count(net, F1)
    net.kill_feosd()
    assert net.qemus()[F1] == pid  # the microVM outlives feosd
    net.start_feosd()
    assert net.ctl_json("pod", "get", F1)["state"] == "running"
    again, after = token_and_count(net, F1)
    assert (again, net.qemus()) == (token, {F1: pid})  # the same QEMU, not a new boot
    assert after > before


def test_a_bring_up_cut_by_a_kill_9_goes_on_in_the_next_feosd(net: PodNet) -> None:
    net.ctl("pod", "create", F2, *CREATE)  # answered: the pod is to come up
    wait_for("F2's guest booting", lambda: step_of(net, F2)[1] == "guest" and F2 in net.qemus())
    pid = net.qemus()[F2]
    net.kill_feosd()
    net.start_feosd()
    pod = net.wait_state(F2, "running")
    assert pod["reason"] == ""
    assert net.qemus()[F2] == pid  # the bring-up took its microVM over rather than boot another
    assert net.exec(F2, "echo", "up").stdout == "up\n"
    net.ctl("pod", "delete", F2)
    assert_gone(net, F2)


def test_a_pod_deleted_after_a_cut_bring_up_leaves_nothing(net: PodNet, f1: str) -> None:
    net.ctl("pod", "create", F3, *CREATE)
    wait_for("F3's microVM", lambda: F3 in net.qemus())
    net.kill_feosd()
    net.start_feosd()
    assert net.ctl("pod", "delete", F3).stdout.strip() == f"pod {F3} deleted"
    assert_gone(net, F3)
    assert net.ctl_json("pod", "get", F1)["state"] == "running"


def test_a_kill_9_mid_suspend_leaves_the_pod_as_its_microvm_is(net: PodNet, f1: str) -> None:
    token, _ = token_and_count(net, F1)
    snapshot = net.state_dir / "vms" / "qemu" / F1 / "snapshot"
    caller = net.ctl_popen("pod", "suspend", F1)
    wait_for("the snapshot being written", (snapshot / "memory.part").exists, timeout=60)
    net.kill_feosd()
    caller.communicate()
    net.start_feosd()
    pod = net.ctl_json("pod", "get", F1)
    # The suspend was never answered: either outcome is the pod's, as long as the pod is what
    # its microVM is.
    assert pod["state"] in ("running", "suspended"), pod
    if pod["state"] == "suspended":
        assert F1 not in net.qemus()
        assert net.ctl_json("pod", "resume", F1)["state"] == "running"
    else:
        assert F1 in net.qemus()
        assert not [f for f in snapshot.iterdir() if f.name in ("memory", "memory.part")]
    assert token_and_count(net, F1)[0] == token


def test_suspend_on_stop_and_the_resume_by_the_next_feosd(net: PodNet, f1: str) -> None:
    token, before = token_and_count(net, F1)
    record = net.state_dir / "suspended-for-stop.json"
    assert net.stop_feosd() == 0  # SIGTERM: the running pods are suspended, then exit 0
    assert json.loads(record.read_text())["pods"] == [F1]
    assert F1 not in net.qemus()
    assert (net.state_dir / "vms" / "qemu" / F1 / "snapshot").exists()
    net.start_feosd()
    net.wait_state(F1, "running", timeout=120)  # resumed by the new feosd once it serves
    wait_for("the record removed", lambda: not record.exists(), timeout=30)
    again, after = token_and_count(net, F1)
    assert again == token
    assert after >= before


def test_conflicting_calls_on_one_pod_are_serialised(net: PodNet, f1: str) -> None:
    suspend = net.ctl_popen("--json", "pod", "suspend", F1)
    stop = net.ctl_popen("--json", "pod", "stop", F1)
    (s_out, s_err), (t_out, t_err) = suspend.communicate(120), stop.communicate(120)
    assert stop.returncode == 0, t_err
    assert json.loads(t_out)["state"] == "stopped"
    if suspend.returncode == 0:  # it ran first, whole: the stop then stopped a suspended pod
        assert json.loads(s_out)["state"] == "suspended"
    else:  # it ran after the stop, and a stopped pod cannot be suspended
        assert suspend.returncode == 19, s_err
        assert "only a running pod can be suspended" in s_err
    pod = net.ctl_json("pod", "get", F1)
    assert pod["state"] == "stopped"
    assert F1 not in net.qemus()
    assert not (net.state_dir / "vms" / "qemu" / F1 / "snapshot" / "memory").exists()
