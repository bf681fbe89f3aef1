"""Real QEMU pods whose disks come from diskd: two pods on one layer, a volume's writes in its
top, a kill -9 of diskd under running pods (they keep their disks, the next diskd takes over),
plain files from before diskd taken over, a feosd without diskd.

One feosd (with its diskd) for the module; its pods boot the installed guest under TCG, without
a network or containers (the guest formats and mounts the volume: that is the writing). The two
pods of the first test are brought up at once (two creates in flight), as a node does.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
from collections.abc import Iterator

import pytest
from feosd_proc import Feosd, end_microvms, running_pod

from feos.vmm import guest_root, newest_guest

VOLUME = "5b1d7e0c-2f4a-4c8e-9d3b-6a7f8e9d0c1b"
SPEC = {"network": {"none": None}, "memoryMib": 256}
WITH_VOLUME = {**SPEC, "volumes": [{"name": "data", "volumeId": VOLUME}]}


def spec_file(node: Feosd, name: str, spec: dict) -> str:  # type: ignore[type-arg]
    path = node.root / f"{name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feosd]:
    daemon = Feosd(tmp_path_factory.mktemp("diskpods"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop(60)
        end_microvms(daemon.state_dir)
        daemon.close()


def on_volume(node: Feosd) -> dict:  # type: ignore[type-arg]
    """Pod dkv0000001a running on the volume, whatever an earlier test left of either."""
    if node.ctl("volume", "get", VOLUME, check=False).returncode == 15:
        node.ctl("volume", "create", VOLUME, "--size", "128MiB")
    return running_pod(node, "dkv0000001a", "-f", spec_file(node, "v", WITH_VOLUME))


def disk(node: Feosd, disk_id: str) -> dict:  # type: ignore[type-arg]
    return dict(node.diskd.ctl_json("disk", disk_id)[0])


def test_two_pods_stand_on_the_guests_layer_with_no_copy(node: Feosd) -> None:
    files = {pod_id: spec_file(node, name, SPEC)
             for pod_id, name in (("dka0000001a", "a"), ("dkb0000001a", "b"))}
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        a, b = pool.map(lambda item: running_pod(node, item[0], "-f", item[1]), files.items())
    disk_a, disk_b = disk(node, a["id"]), disk(node, b["id"])
    assert disk_a["layers"] == disk_b["layers"] and len(disk_a["layers"]) == 1
    for d in (disk_a, disk_b):
        assert d["state"] == "started" and d["vmm"] == "qemu" and d["format"] == "qcow2"
        assert d["kind"] == "pod"
    layers = {x["digest"]: x for x in node.diskd.ctl_json("layers")}
    l0 = layers[disk_a["base"]]
    assert l0["disks"] == 2 and l0["guest"] == a["guestVersion"]
    # The guest grew its filesystem and wrote to it: into the tops alone, the layer untouched.
    layer_file = node.state_dir / "disk" / "layers" / l0["digest"].replace(":", "-")
    assert layer_file.stat().st_mode & 0o222 == 0
    assert disk_a["allocatedBytes"] < l0["sizeBytes"] + (64 << 20)
    # QEMU opened the chain itself: the top and the layer linked into its directory.
    vm_dir = node.state_dir / "vms" / "qemu" / a["id"]
    assert (vm_dir / layer_file.name).stat().st_ino == layer_file.stat().st_ino
    assert (vm_dir / "data").stat().st_ino == \
        (node.state_dir / "disk" / "disks" / a["id"] / "top.qcow2").stat().st_ino


def test_a_volume_is_a_disk_on_the_empty_layer_written_by_its_pod(node: Feosd) -> None:
    on_volume(node)
    volume = disk(node, VOLUME)
    assert volume["kind"] == "volume" and volume["state"] == "started"
    assert volume["sizeBytes"] == 128 << 20
    assert volume["allocatedBytes"] > 1 << 20  # the guest's mkfs wrote into its top
    assert node.ctl_json("volume", "get", VOLUME)["formatted"] is True


def test_a_stopped_pod_stops_its_disks_and_starts_them_again(node: Feosd) -> None:
    on_volume(node)
    node.ctl("pod", "stop", "dkv0000001a")
    assert disk(node, "dkv0000001a")["state"] == "stopped"
    assert disk(node, VOLUME)["state"] == "stopped"
    started = node.ctl_json("pod", "start", "dkv0000001a", "--wait")
    assert started["state"] == "running"
    assert disk(node, "dkv0000001a")["state"] == "started"
    assert disk(node, VOLUME)["state"] == "started"


def test_a_kill_of_diskd_leaves_the_pods_their_disks(node: Feosd) -> None:
    on_volume(node)
    before = disk(node, VOLUME)
    node.diskd.kill()
    # The pod runs on: QEMU holds its chain; its guest answers, and suspends and resumes
    # (the resume waits for a diskd, which comes back meanwhile).
    assert node.ctl_json("pod", "get", "dkv0000001a")["state"] == "running"
    suspended = node.ctl_json("pod", "suspend", "dkv0000001a")
    assert suspended["state"] == "suspended"
    node.diskd.start()
    assert disk(node, VOLUME)["layers"] == before["layers"]
    resumed = node.ctl_json("pod", "resume", "dkv0000001a")
    assert resumed["state"] == "running"
    # Its volume, written before the kill, mounts again at the next boot without a format.
    node.ctl("pod", "stop", "dkv0000001a")
    assert node.ctl_json("pod", "start", "dkv0000001a", "--wait")["state"] == "running"
    assert node.ctl_json("volume", "get", VOLUME)["formatted"] is True


def test_a_deleted_pod_takes_its_disk_and_its_volume_goes_with_delete_volume(node: Feosd) -> None:
    on_volume(node)
    node.ctl("pod", "delete", "dkv0000001a")
    assert node.diskd.ctl("disk", "dkv0000001a", check=False).returncode == 4
    assert disk(node, VOLUME)["state"] == "stopped"  # the volume stays, its disk stopped
    node.ctl("volume", "delete", VOLUME)
    assert node.diskd.ctl("disk", VOLUME, check=False).returncode == 4


def test_plain_files_from_before_diskd_are_taken_over(tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    """A node of today's plain files: a volume's <state>/volumes/<id>.disk is diskd's after
    feosd's first start with diskd, a pod's <state>/disk/pods/<id>.img at its bring-up; both
    moved (the same inode), and the pod boots on them."""
    root = tmp_path_factory.mktemp("plain")
    old = Feosd(root)
    try:
        old.start()
        old.ctl("volume", "create", VOLUME, "--size", "128MiB")
        old.stop(60)
        plain_volume = old.state_dir / "volumes" / f"{VOLUME}.disk"
        with open(plain_volume, "wb") as f:  # as feosd before diskd made it: sparse
            f.truncate(128 << 20)
        plain_pod = old.state_dir / "disk" / "pods" / "dkp0000001a.img"
        plain_pod.parent.mkdir(parents=True, exist_ok=True)
        _, guest_dir = newest_guest(guest_root())
        blank = guest_dir / "data.img.zst"
        subprocess.run(["zstd", "-q", "-d", "--sparse", "-f", "-o", str(plain_pod), str(blank)],
                       check=True)
        inodes = {p: p.stat().st_ino for p in (plain_pod, plain_volume)}
        old.start()
        taken = dict(old.diskd.ctl_json("disk", VOLUME)[0])  # at feosd's start, before any pod
        assert taken["base"] == "" and taken["format"] == "raw" and not plain_volume.exists()
        pod = running_pod(old, "dkp0000001a", "-f", spec_file(old, "p", WITH_VOLUME))
        assert pod["state"] == "running"
        disks = old.state_dir / "disk" / "disks"
        for disk_id, plain in (("dkp0000001a", plain_pod), (VOLUME, plain_volume)):
            taken = dict(old.diskd.ctl_json("disk", disk_id)[0])
            assert taken["base"] == "" and taken["format"] == "raw"
            assert taken["state"] == "started"
            assert not plain.exists()
            assert os.stat(disks / disk_id / "top.raw").st_ino == inodes[plain]
        assert old.ctl_json("volume", "get", VOLUME)["formatted"] is True
    finally:
        old.stop(60)
        end_microvms(old.state_dir)
        old.close()


def test_without_diskd_a_pod_fails_naming_diskd(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("nodiskd")
    lone = Feosd(root, "--disk-wait", "2")
    try:
        lone.start()
        lone.diskd.stop()
        made = lone.ctl("pod", "create", "dkn0000001a", "-f", spec_file(lone, "n", SPEC),
                        "--wait", check=False)
        assert made.returncode == 19, made.stderr
        failed = lone.ctl_json("pod", "get", "dkn0000001a")
        assert failed["state"] == "failed"
        assert "diskd did not answer within 2s" in failed["reason"]
    finally:
        lone.close()
        end_microvms(lone.state_dir)
