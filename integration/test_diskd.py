"""diskd as a process: its lock, READY, layers and disks with no copy, the FUSE export for
Firecracker, a kill -9 of diskd under a served disk, a stop's flush, --stop-after-lock, the
take-over of a plain file, bake and collect. No microVM boots here (test_pods_diskd.py does)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from diskd_proc import DiskdProc, exports_under

from feos.disk import EMPTY_DIGEST
from feos.errors import Code, FeosError
from feos.vmm import guest_root, newest_guest

MIB = 1 << 20


def _image(path: Path, size: int = 64 * MIB) -> bytes:
    """A sparse raw image with a recognisable first MiB and a block at 32 MiB."""
    head = hashlib.sha256(path.name.encode()).digest() * (MIB // 32)
    with open(path, "wb") as f:
        f.write(head)
        f.seek(32 * MIB)
        f.write(b"L" * 4096)
        f.truncate(size)
    return head


def _read(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _write(path: Path, offset: int, data: bytes, *, sync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("diskd")
    with DiskdProc(root / "disk").start() as diskd:
        yield diskd


@pytest.fixture(scope="module")
def layer(node: DiskdProc, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    source = tmp_path_factory.mktemp("images") / "l0.img"
    head = _image(source)
    answer = node.call("importLayer", path=str(source), guest="test-guest")["layer"]
    return answer, head


def test_a_waiting_diskd_says_so_and_serves_once_the_lock_is_free(tmp_path: Path) -> None:
    state = tmp_path / "disk"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    with DiskdProc(state).start() as first:
        second = DiskdProc(state, env={"NOTIFY_SOCKET": str(tmp_path / "notify")},
                           log=tmp_path / "second.log")
        with second:
            second.spawn()
            deadline = time.monotonic() + 20
            while "holds" not in second.log_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"another diskd (pid {first.proc.pid}) holds" in second.log_text()  # type: ignore[union-attr]
            assert first.stop() == 0
            assert notify.recv(64) == b"READY=1"
            second.wait_serving()
            assert second.call("info")["info"]["pid"] == second.proc.pid  # type: ignore[union-attr]
    notify.close()


def test_info_says_why_there_is_no_object_store_nor_ublk(node: DiskdProc) -> None:
    info = node.ctl_json("info")[0]
    assert info["store"]["configured"] is False
    assert "S3_BUCKET" in info["store"]["reason"]
    assert info["ublk"].startswith("unavailable")
    with pytest.raises(FeosError) as caught:
        node.call("push", digest=EMPTY_DIGEST)
    assert caught.value.code is Code.FAILED_PRECONDITION
    assert caught.value.message.startswith("diskd has no object store: ")


def test_bad_input_is_refused_naming_the_field(node: DiskdProc) -> None:
    for params, code, word in [
        ({"id": "no/slash", "kind": "pod", "sizeBytes": MIB}, Code.INVALID_ARGUMENT, "id"),
        ({"id": "ok", "kind": "pod", "sizeBytes": MIB, "base": "sha256:" + "0" * 64},
         Code.NOT_FOUND, "no layer"),
        ({"id": "ok", "kind": "pod", "sizeBytes": MIB, "base": "nope"},
         Code.INVALID_ARGUMENT, "base"),
        ({"id": "ok", "kind": "pod", "sizeBytes": 0}, Code.INVALID_ARGUMENT, "sizeBytes"),
    ]:
        with pytest.raises(FeosError) as caught:
            node.call("createDisk", **params)
        assert caught.value.code is code and word in caught.value.message, params
    with pytest.raises(FeosError) as caught:
        node.call("importLayer", path="/nonexistent/data.img.zst", guest="g")
    assert caught.value.code is Code.INVALID_ARGUMENT


def test_the_guests_blank_volume_imports_once_as_a_read_only_layer(node: DiskdProc) -> None:
    _, guest_dir = newest_guest(guest_root())
    zst = guest_dir / "data.img.zst"
    first = node.call("importLayer", path=str(zst), guest=guest_dir.name)["layer"]
    again = node.call("importLayer", path=str(zst), guest=guest_dir.name)["layer"]
    assert first == again
    assert first["digest"] == "sha256:" + hashlib.sha256(zst.read_bytes()).hexdigest()
    assert first["virtualBytes"] >= 64 * MIB and first["parent"] == ""
    path = node.state_dir / "layers" / first["digest"].replace(":", "-")
    assert path.stat().st_mode & 0o777 == 0o444
    assert path.stat().st_blocks * 512 < first["virtualBytes"] // 8  # unpacked sparse


def test_two_disks_on_one_layer_copy_nothing(node: DiskdProc, layer) -> None:  # type: ignore[no-untyped-def]
    base, _ = layer
    a = node.call("createDisk", id="share-a", kind="pod", sizeBytes=128 * MIB,
                  base=base["digest"])["disk"]
    b = node.call("createDisk", id="share-b", kind="pod", sizeBytes=0, base=base["digest"])["disk"]
    assert a["layers"] == b["layers"] == [base["digest"]]
    assert a["sizeBytes"] == 128 * MIB and b["sizeBytes"] == base["virtualBytes"]
    for disk in (a, b):
        assert disk["allocatedBytes"] < 512 * 1024, disk  # a qcow2 header and tables: no copy
        assert disk["state"] == "stopped" and disk["format"] == "qcow2"
    layers = {x["digest"]: x for x in node.ctl_json("layers")}
    assert layers[base["digest"]]["disks"] == 2
    again = node.call("createDisk", id="share-a", kind="pod", sizeBytes=128 * MIB,
                      base=base["digest"])["disk"]
    assert again["id"] == "share-a"  # a create that comes again finds it
    with pytest.raises(FeosError) as caught:
        node.call("createDisk", id="share-a", kind="volume", sizeBytes=MIB)
    assert caught.value.code is Code.ALREADY_EXISTS
    qemu = node.call("startDisk", id="share-a", vmm="qemu", ownerUid=0)["disk"]
    assert qemu["format"] == "qcow2" and qemu["path"].endswith("/disks/share-a/top.qcow2")
    assert qemu["dataPathPid"] == 0  # QEMU opens the chain itself
    with pytest.raises(FeosError) as caught:
        node.call("startDisk", id="share-a", vmm="firecracker", ownerUid=0)
    assert caught.value.code is Code.FAILED_PRECONDITION
    for disk_id in ("share-a", "share-b"):
        node.call("deleteDisk", id=disk_id)
    with pytest.raises(FeosError) as caught:
        node.call("getDisk", id="share-a")
    assert caught.value.code is Code.NOT_FOUND


def test_firecrackers_raw_file_reads_the_layer_and_takes_writes(node: DiskdProc, layer) -> None:  # type: ignore[no-untyped-def]
    base, head = layer
    node.call("createDisk", id="fc-raw", kind="pod", sizeBytes=0, base=base["digest"])
    disk = node.call("startDisk", id="fc-raw", vmm="firecracker", ownerUid=4321)["disk"]
    try:
        export = Path(disk["path"])
        assert disk["format"] == "raw" and disk["dataPathPid"] > 0
        assert export.stat().st_size == base["virtualBytes"]
        assert export.stat().st_uid == 4321  # the microVM's own user opens it (allow_other)
        assert _read(export, 0, MIB) == head
        assert _read(export, 32 * MIB, 4096) == b"L" * 4096
        _write(export, 8 * MIB, b"top!" * 1024, sync=True)
        assert _read(export, 8 * MIB, 4096) == b"top!" * 1024
        layer_file = node.state_dir / "layers" / base["digest"].replace(":", "-")
        assert _read(layer_file, 8 * MIB, 4096) == b"\0" * 4096  # the layer is not written
        assert disk["allocatedBytes"] < MIB
    finally:
        node.call("deleteDisk", id="fc-raw")
    assert not _alive(disk["dataPathPid"])


def _top_format(top: Path) -> tuple[int, bool]:
    info = json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", str(top)],
                                     capture_output=True, text=True, check=True).stdout)
    return info["cluster-size"], info["format-specific"]["data"].get("extended-l2", False)


def test_new_tops_have_large_clusters_and_a_top_made_before_keeps_its_own(  # type: ignore[no-untyped-def]
        node: DiskdProc, layer) -> None:
    """New tops: 1 MiB clusters of 32 KiB subclusters (docs/disk.md, "A top's format"). A top of
    qcow2's defaults, as diskd made them before, is served as it is and stays in its format."""
    base, head = layer
    node.call("createDisk", id="new-top", kind="pod", sizeBytes=0, base=base["digest"])
    node.call("createDisk", id="old-top", kind="pod", sizeBytes=0, base=base["digest"])
    try:
        assert _top_format(node.state_dir / "disks" / "new-top" / "top.qcow2") == (MIB, True)
        old = node.state_dir / "disks" / "old-top" / "top.qcow2"
        old.unlink()  # the top as diskd made it before: 64 KiB clusters, data written in
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=off",
                        "-b", base["digest"].replace(":", "-"), "-F", "raw", str(old),
                        str(base["virtualBytes"])], check=True)
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x4f 4M 64k", str(old)],
                       check=True, capture_output=True)
        disk = node.call("startDisk", id="old-top", vmm="firecracker", ownerUid=0)["disk"]
        export = Path(disk["path"])
        assert _read(export, 0, MIB) == head  # the layer beneath
        assert _read(export, 4 * MIB, 64 * 1024) == b"\x4f" * 64 * 1024  # the old top's data
        _write(export, 16 * MIB, b"more" * 1024, sync=True)
        node.call("stopDisk", id="old-top")
        assert _top_format(old) == (64 * 1024, False)  # not rewritten
        again = node.call("startDisk", id="old-top", vmm="firecracker", ownerUid=0)["disk"]
        assert _read(Path(again["path"]), 16 * MIB, 4096) == b"more" * 1024
    finally:
        for disk_id in ("new-top", "old-top"):
            node.call("deleteDisk", id=disk_id)


def test_stop_flushes_what_was_written_and_ends_the_export(node: DiskdProc) -> None:
    node.call("createDisk", id="flush", kind="volume", sizeBytes=64 * MIB)
    try:
        disk = node.call("startDisk", id="flush", vmm="firecracker", ownerUid=0)["disk"]
        _write(Path(disk["path"]), 5 * MIB, b"kept" * 1024)  # no fsync: the stop flushes it
        stopped = node.call("stopDisk", id="flush")["disk"]
        assert stopped["state"] == "stopped" and stopped["path"] == ""
        assert not _alive(disk["dataPathPid"])
        assert str(node.state_dir) not in Path("/proc/self/mountinfo").read_text()
        again = node.call("startDisk", id="flush", vmm="firecracker", ownerUid=0)["disk"]
        assert _read(Path(again["path"]), 5 * MIB, 4096) == b"kept" * 1024
        assert _read(Path(again["path"]), 0, 4096) == b"\0" * 4096  # the volumes' empty L0
        assert again["layers"] == [EMPTY_DIGEST]
    finally:
        node.call("deleteDisk", id="flush")


def test_a_kill_of_diskd_leaves_the_export_serving_and_the_next_adopts_it(
        tmp_path: Path) -> None:
    source = tmp_path / "img"
    head = _image(source)
    state = tmp_path / "disk"
    with DiskdProc(state).start() as first:
        digest = first.call("importLayer", path=str(source), guest="g")["layer"]["digest"]
        first.call("createDisk", id="survivor", kind="pod", sizeBytes=0, base=digest)
        disk = first.call("startDisk", id="survivor", vmm="firecracker", ownerUid=0)["disk"]
        export = Path(disk["path"])
        fd = os.open(export, os.O_RDWR)  # as a VMM holds it
        try:
            first.kill()
            os.pwrite(fd, b"after kill" * 400, 2 * MIB)
            os.fsync(fd)
            assert os.pread(fd, MIB, 0) == head
            with DiskdProc(state, log=tmp_path / "second.log").start() as second:
                adopted = second.call("getDisk", id="survivor")["disk"]
                assert adopted["state"] == "started"
                assert adopted["dataPathPid"] == disk["dataPathPid"]
                assert "adopted its export" in second.log_text()
                assert os.pread(fd, 4000, 2 * MIB) == b"after kill" * 400
                os.close(fd)
                fd = -1
                second.call("stopDisk", id="survivor")
                assert not _alive(disk["dataPathPid"])
        finally:
            if fd >= 0:
                os.close(fd)


def test_stop_after_lock_serves_on_until_the_lock_is_free(tmp_path: Path) -> None:
    lock = tmp_path / "feosd.lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with DiskdProc(tmp_path / "disk", "--stop-after-lock", str(lock)).start() as diskd:
            assert diskd.proc is not None
            diskd.proc.terminate()
            time.sleep(1.5)
            assert diskd.proc.poll() is None
            assert diskd.call("info")["info"]["pid"] == diskd.proc.pid  # still serving
            assert "serving on until no process holds" in diskd.log_text()
            fcntl.flock(holder, fcntl.LOCK_UN)
            assert diskd.proc.wait(10) == 0
    finally:
        os.close(holder)


def test_a_plain_file_is_taken_over_without_a_copy(node: DiskdProc, tmp_path: Path) -> None:
    plain = node.state_dir / "pods" / "old-pod.img"  # <feosd-state>/disk/pods/<id>.img
    plain.parent.mkdir(exist_ok=True)
    head = _image(plain, 32 * MIB)
    inode = plain.stat().st_ino
    disk = node.call("adoptDisk", id="old-pod", kind="pod", path=str(plain))["disk"]
    try:
        assert not plain.exists()
        assert disk["base"] == "" and disk["layers"] == [] and disk["format"] == "raw"
        top = node.state_dir / "disks" / "old-pod" / "top.raw"
        assert top.stat().st_ino == inode  # moved, not copied
        assert node.call("adoptDisk", id="old-pod", kind="pod", path=str(plain))["disk"] == disk
        served = node.call("startDisk", id="old-pod", vmm="firecracker", ownerUid=0)["disk"]
        assert _read(Path(served["path"]), 0, MIB) == head
        with pytest.raises(FeosError) as caught:
            node.call("bake", id="old-pod", image="x")
        assert caught.value.code is Code.FAILED_PRECONDITION
    finally:
        node.call("deleteDisk", id="old-pod")


def test_bake_seals_the_top_and_collect_removes_children_first(tmp_path: Path) -> None:
    source = tmp_path / "img"
    _image(source)
    guests = tmp_path / "guests"
    (guests / "installed").mkdir(parents=True)
    (guests / "installed" / "manifest.json").write_text("{}")
    state = tmp_path / "disk"
    with DiskdProc(state, "--guest-dir", str(guests)).start() as diskd:
        gone = diskd.call("importLayer", path=str(source), guest="removed-guest")["layer"]
        other = tmp_path / "img2"
        _image(other)
        kept = diskd.call("importLayer", path=str(other), guest="installed")["layer"]
        diskd.call("createDisk", id="baker", kind="pod", sizeBytes=0, base=gone["digest"])
        disk = diskd.call("startDisk", id="baker", vmm="firecracker", ownerUid=0)["disk"]
        _write(Path(disk["path"]), 3 * MIB, b"baked in" * 512, sync=True)
        baked = diskd.call("bake", id="baker", image="example/app:1")["layer"]
        assert baked["parent"] == gone["digest"] and baked["image"] == "example/app:1"
        diskd.call("createDisk", id="on-baked", kind="pod", sizeBytes=0, base=baked["digest"])
        child = diskd.call("startDisk", id="on-baked", vmm="firecracker", ownerUid=0)["disk"]
        assert child["layers"] == [baked["digest"], gone["digest"]]
        assert _read(Path(child["path"]), 3 * MIB, 4096) == b"baked in" * 512
        collected = diskd.call("collect")
        assert collected["layersRemoved"] == 0  # every layer has a disk or an installed guest
        for disk_id in ("baker", "on-baked"):
            diskd.call("deleteDisk", id=disk_id)
        collected = diskd.call("collect")
        assert collected["layersRemoved"] == 2 and collected["bytesFreed"] > 0
        left = {x["digest"] for x in diskd.ctl_json("layers")}
        assert left == {EMPTY_DIGEST, kept["digest"]}
        log = diskd.log_text()
        assert log.index(f"layer {baked['digest']}: collected") < \
            log.index(f"layer {gone['digest']}: collected")


def test_a_full_disk_fails_the_write_and_keeps_what_was_flushed(tmp_path: Path) -> None:
    """diskd's state on a 24 MiB tmpfs of the test's own: a volume of 64 MiB fills it; the write
    that finds it full fails (an I/O error), and what was flushed before reads back, also after
    the disk's stop and start."""
    from _owner import OWNER

    state = tmp_path / "small"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(state)], check=True)
    try:
        with DiskdProc(state / "disk", log=tmp_path / "diskd.log").start() as diskd:
            diskd.call("createDisk", id="full", kind="volume", sizeBytes=64 * MIB)
            path = Path(diskd.call("startDisk", id="full", vmm="firecracker",
                                   ownerUid=0)["disk"]["path"])
            kept = os.urandom(4 * MIB)
            _write(path, 0, kept, sync=True)  # acknowledged
            fd = os.open(path, os.O_WRONLY)
            failed: OSError | None = None
            try:
                for offset in range(8 * MIB, 64 * MIB, MIB):
                    os.pwrite(fd, os.urandom(MIB), offset)
                    os.fsync(fd)
            except OSError as exc:
                failed = exc
            finally:
                os.close(fd)
            assert failed is not None, "24 MiB held 56 MiB of random data"
            assert failed.errno in (errno.EIO, errno.ENOSPC), failed
            assert _read(path, 0, 4 * MIB) == kept
            diskd.call("stopDisk", id="full")
            with pytest.raises(FeosError) as caught:  # its record cannot be written now
                diskd.call("startDisk", id="full", vmm="firecracker", ownerUid=0)
            assert caught.value.code is Code.RESOURCE_EXHAUSTED
            assert exports_under(state) == []  # the export it started was ended again
            copy = tmp_path / "copy.raw"  # the chain read whole, off the full filesystem
            top = state / "disk" / "disks" / "full" / "top.qcow2"
            subprocess.run(["qemu-img", "convert", "-O", "raw", str(top), str(copy)], check=True)
            assert _read(copy, 0, 4 * MIB) == kept
    finally:
        OWNER.done(state / "disk")  # its exports end and their mounts go first
        subprocess.run(["umount", "-l", str(state)], check=False)
