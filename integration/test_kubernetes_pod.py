"""feosd in its OCI image, run as feos-node's DaemonSet runs it (integration/podman_pod.py):
container mode in a pod sharing its PID namespace, a pod created from inside it, a rollout that
keeps the pod (suspend on stop, resumed by the next feos-node pod), and a feos-node pod killed
mid-stop that leaves what it suspended to the next one (the suspend-on-stop record).

One node for the module; its tests run in order, each also alone (running_pod makes or brings
back K1). Two guest boots (K1, and K2 in the kill test) and three resumes, QEMU under TCG.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from feosd_proc import running_pod
from podman_pod import PodmanNode, record
from podnet import IMAGE

K1, K2 = "ka0000000aa", "kb0000000bb"
LOOP = ("t=$(cat /proc/sys/kernel/random/uuid); n=0; "
        "while :; do n=$((n+1)); echo \"$t $n\" > /tmp/n; sleep 0.2; done")
CREATE = ("--memory", "256MiB", "--image", IMAGE, "--cmd", "/bin/sh", "-c", LOOP)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanNode]:
    with PodmanNode(tmp_path_factory.mktemp("k8spod")) as n:
        yield n


def token_and_count(node: PodmanNode, pod_id: str) -> tuple[str, int]:
    token, count = node.exec(pod_id, "cat", "/tmp/n").stdout.split()
    return token, int(count)


def wait_for(what: str, check: object, timeout: float = 120, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(every)
    raise AssertionError(f"not seen within {timeout}s: {what}")


def container_cgroup(node: PodmanNode) -> dict[str, str]:
    """feosd's container's cgroup by hierarchy: feosd is in feosd/ of it."""
    own = node.cgroups_of(node.host_pid("feosd"))
    for h in ("cpu", "memory", "pids"):
        assert own[h].endswith("/feosd"), own
    return {h: own[h].removesuffix("/feosd") for h in ("cpu", "memory", "pids")}


def test_feosd_runs_in_container_mode_in_the_pod(node: PodmanNode) -> None:
    pid = node.host_pid("feosd")
    # the infra container is PID 1 of the pod's PID namespace (shareProcessNamespace), not feosd
    pid1 = node.podman("exec", node.name("feosd"), "cat", "/proc/1/cmdline")
    assert "catatonit" in pid1
    nspid = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                 if line.startswith("NSpid:")).split()[1:]
    assert len(nspid) == 2 and nspid[1] != "1"
    # feosd moved into feosd/ of its container's cgroup, vms/ made beside it
    for h, path in container_cgroup(node).items():
        assert Path(f"/sys/fs/cgroup/{h}{path}/vms").is_dir(), h
    assert "NOTIFY_SOCKET" not in node.environ_of(pid)  # nothing waits for it
    assert "in a container (a cgroup namespace of its own)" in node.logs("feosd")
    # feosd serves while its VMM probe runs (a fresh container has no cached answer in /run):
    # host info names no driver until the probe has decided
    wait_for("the VMM decided", lambda: "driver" in node.ctl_json("host", "info")["vmm"])
    info = node.ctl_json("host", "info")
    assert info["vmm"]["driver"] == "qemu", info


def test_a_pod_created_from_inside_runs_in_vms_of_the_container(node: PodmanNode) -> None:
    running_pod(node, K1, *CREATE)
    assert node.exec(K1, "echo", "hi").stdout == "hi\n"
    qemu = node.qemus()[K1]
    cgroups, base = node.cgroups_of(qemu), container_cgroup(node)
    for h in ("cpu", "memory", "pids"):
        assert cgroups[h] == f"{base[h]}/vms/{K1}", (h, cgroups[h])


def test_a_rollout_suspends_the_pod_and_the_next_feos_node_resumes_it(node: PodmanNode) -> None:
    running_pod(node, K1, *CREATE)
    token, before = token_and_count(node, K1)
    assert node.end_pod() == 0  # SIGTERM: K1 suspended into /var/lib/feos, then exit 0
    assert record(node) == [K1]
    assert K1 not in node.qemus()  # the container ended, and its microVMs with it
    assert (node.state_dir / "vms" / "qemu" / K1 / "snapshot").exists()
    node.start_feosd()  # the DaemonSet's next pod on the node
    pod = node.wait_state(K1, "running", timeout=180)
    assert pod["reason"] == ""
    wait_for("the record removed", lambda: not record(node), timeout=60)
    again, after = token_and_count(node, K1)
    assert again == token and after >= before  # the same guest, its memory kept


def test_a_pod_killed_mid_stop_leaves_what_it_suspended_to_the_next(node: PodmanNode) -> None:
    running_pod(node, K1, *CREATE)
    token, _ = token_and_count(node, K1)
    # K2's bring-up is a change in flight, which the stop waits for after suspending K1: the
    # kill lands while the stop waits, with K1 suspended and recorded and K2 not
    create = node.ctl_popen("pod", "create", K2, "--wait", *CREATE)
    wait_for("K2 being brought up",
             lambda: node.ctl_json("pod", "get", K2).get("step") in ("vm", "guest")
             if node.ctl("pod", "get", K2, check=False).returncode == 0 else False)
    node.sigterm_feosd()
    wait_for("K1 in the record", lambda: K1 in record(node), timeout=120, every=0.01)
    node.kill_feosd()  # mid-stop: past its grace, or the OOM killer
    create.communicate(timeout=60)
    assert node.exit_code("feosd") == 137, node.logs("feosd")  # killed, not ended on its own
    assert record(node) == [K1]
    assert not node.qemus()  # the microVMs ended with the container, K2's too
    node.remove_pod()
    node.start_feosd()
    node.wait_state(K1, "running", timeout=180)  # what the killed stop suspended, resumed
    wait_for("the record removed", lambda: not record(node), timeout=60)
    assert token_and_count(node, K1)[0] == token
    # K2's microVM ended with the container, as on a crash: the next feosd settles it (a bring-up
    # cut off goes on in the next feosd, operations.md), no pod is left half-way
    wait_for("K2 settled", lambda: node.ctl_json("pod", "get", K2)["state"]
             in ("failed", "stopped", "running"), timeout=180)
