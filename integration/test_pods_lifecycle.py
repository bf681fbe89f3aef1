"""Pods without a network, driven with feosctl: the life cycle over real QEMU microVMs.

One feosd for the module; its pods boot the installed guest under TCG. The tests share pod A,
which the fixture pod_a makes (or brings back to running) for each test that needs it. (Pods with containers
need a registry, and so a network: test_pods_network.py.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from feosd_proc import Feosd, end_microvms, records_gone, running_pod

VOLUME = "3f0c2a51-6b7e-4d1c-9a8f-2e5d4c3b2a10"
SPEC = {"network": {"none": None}, "memoryMib": 256,
        "volumes": [{"name": "data", "volumeId": VOLUME}]}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feosd]:
    daemon = Feosd(tmp_path_factory.mktemp("pods"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop(60)
        end_microvms(daemon.state_dir)


def spec_file(node: Feosd, name: str, spec: dict) -> str:  # type: ignore[type-arg]
    path = node.root / f"{name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.fixture
def pod_a(node: Feosd) -> str:
    """Pod A running on its volume, made by the first test that needs it."""
    if node.ctl("volume", "get", VOLUME, check=False).returncode == 15:
        node.ctl("volume", "create", VOLUME, "--size", "256MiB")
    running_pod(node, "pa00000001a", "-f", spec_file(node, "a", SPEC))
    return "pa00000001a"


def test_create_runs_the_pod_and_mounts_its_volume(node: Feosd) -> None:
    node.ctl("volume", "create", VOLUME, "--size", "256MiB")
    created = node.ctl_json("pod", "create", "pa00000001a", "-f", spec_file(node, "a", SPEC),
                            "--wait")
    assert created["state"] == "running"
    assert created["guestVersion"]
    assert created["driver"] == "qemu"
    volume = node.ctl_json("volume", "get", VOLUME)
    assert volume["state"] == "attached"
    assert volume["podId"] == "pa00000001a"
    assert volume["formatted"] is True  # the guest formatted and mounted it
    # The same ID and spec find the pod; another spec is refused.
    again = node.ctl_json("pod", "create", "pa00000001a", "-f", spec_file(node, "a", SPEC))
    assert again["id"] == "pa00000001a"
    other = node.ctl("pod", "create", "pa00000001a", "-f",
                     spec_file(node, "b", {**SPEC, "memoryMib": 512}), check=False)
    assert other.returncode == 16


def test_a_volume_is_one_pods_at_a_time(node: Feosd, pod_a: str) -> None:
    taken = node.ctl("pod", "create", "pb00000001a", "-f", spec_file(node, "c", SPEC), check=False)
    assert taken.returncode == 19
    assert "attached to pod pa00000001a" in taken.stderr
    assert node.ctl("pod", "get", "pb00000001a", check=False).returncode == 15
    busy = node.ctl("volume", "delete", VOLUME, check=False)
    assert busy.returncode == 19


def test_suspend_and_resume(node: Feosd, pod_a: str) -> None:
    suspended = node.ctl_json("pod", "suspend", "pa00000001a")
    assert suspended["state"] == "suspended"
    memory = next(node.state_dir.glob("vms/qemu/pa00000001a/snapshot/memory"))
    # QEMU's migration stream leaves the guest's zero pages out: well below its 256 MiB.
    assert memory.stat().st_size < 200 << 20
    resumed = node.ctl_json("pod", "resume", "pa00000001a")
    assert resumed["state"] == "running"
    assert not memory.exists()
    # Resuming a running pod changes nothing; suspending twice neither.
    assert node.ctl_json("pod", "resume", "pa00000001a")["state"] == "running"


def test_stop_and_start_on_the_same_disk(node: Feosd, pod_a: str) -> None:
    stopped = node.ctl_json("pod", "stop", "pa00000001a")
    assert stopped["state"] == "stopped"
    disk = node.state_dir / "disk" / "disks" / "pa00000001a" / "top.qcow2"  # diskd's
    assert disk.exists()
    refused = node.ctl("pod", "suspend", "pa00000001a", check=False)
    assert refused.returncode == 19
    assert "only a running pod can be suspended" in refused.stderr
    started = node.ctl_json("pod", "start", "pa00000001a", "--wait")
    assert started["state"] == "running"


def test_bad_specs_are_refused_naming_the_field(node: Feosd) -> None:
    cases = [
        ({"vcpus": 99}, "spec.vcpus"),
        ({"memoryMib": 100}, "spec.memoryMib"),
        ({"volumes": [{"name": "Bad_Name", "volumeId": VOLUME}]}, "spec.volumes[0].name"),
        ({"containers": [{"name": "x", "image": "UPPER/case"}]}, "spec.containers[0].image"),
        ({"containers": [{"name": "x", "image": "busybox",
                          "volumeMounts": [{"volume": "nope", "path": "/d"}]}]},
         "spec.containers[0].volumeMounts[0].volume"),
        ({"metadataJson": "[1]"}, "spec.metadata"),
    ]
    for change, field in cases:
        done = node.ctl("pod", "create", "pc00000001a", "-f",
                        spec_file(node, "bad", {"network": {"none": None}, **change}), check=False)
        assert done.returncode == 13, (change, done.stderr)
        assert field in done.stderr
    bad_id = node.ctl("pod", "create", "Not-An-Id", "-f", spec_file(node, "d", SPEC), check=False)
    assert bad_id.returncode == 13
    assert "id: must be 11 of lowercase Crockford base32" in bad_id.stderr


def test_a_network_needs_a_prefix(node: Feosd) -> None:
    done = node.ctl("pod", "create", "pd00000001a", "-f", spec_file(node, "e", {"memoryMib": 256}),
                    check=False)
    assert done.returncode == 19
    assert "pods with a network cannot be made" in done.stderr


def test_events_follow_the_changes(node: Feosd, pod_a: str) -> None:
    import subprocess

    from feosd_proc import BIN

    watch = subprocess.Popen([str(BIN / "feosctl"), "--socket", str(node.socket), "--json",
                              "pod", "events", "pa00000001a"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        node.ctl("pod", "suspend", "pa00000001a")
        node.ctl("pod", "resume", "pa00000001a")
        states = []
        assert watch.stdout is not None
        while len(states) < 2:
            states.append(json.loads(watch.stdout.readline())["state"])
        assert states == ["suspended", "running"]
    finally:
        watch.kill()
        watch.wait()
        if watch.stdout is not None:
            watch.stdout.close()


def test_delete_leaves_the_volume_available(node: Feosd, pod_a: str) -> None:
    node.ctl("pod", "delete", "pa00000001a")
    assert node.ctl("pod", "get", "pa00000001a", check=False).returncode == 15
    volume = node.ctl_json("volume", "get", VOLUME)
    assert volume["state"] == "available"
    assert volume["podId"] == ""
    assert volume["formatted"] is True
    assert not (node.state_dir / "disk" / "disks" / "pa00000001a").exists()
    assert records_gone(node.state_dir / "pods", "pa00000001a.pb")
    assert not list(node.state_dir.glob("vms/qemu/pa00000001a"))
