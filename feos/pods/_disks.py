"""The pods' disks, as files until diskd serves them (docs/operations.md, "Disks").

A pod's disk is <state-dir>/disk/pods/<id>.img, made on the guest's blank data volume (its
data.img.zst unpacked sparse, once per guest version into <state-dir>/disk/blank/<version>.img,
then copied sparse) the first time the pod boots, and kept across stops until the pod
is deleted. A volume's disk is <state-dir>/volumes/<id>.disk, a sparse file of the volume's size
made at its first boot; the guest formats it.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import trio

from ..errors import Code, FeosError
from ..records import fsync_dir


def pod_disk(state_dir: Path, pod_id: str) -> Path:
    return state_dir / "disk" / "pods" / f"{pod_id}.img"


_UNPACKING = threading.Lock()


def _run(argv: list[str], tmp: Path, what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise FeosError(Code.INTERNAL, f"{what}: {done.stderr.strip()}")


def _unpacked(blank: Path, cache: Path) -> Path:
    """The guest's blank data volume unpacked, once per guest version: zstd goes through all of
    its gigabytes of zeros (seconds under load), a sparse copy of the result takes milliseconds."""
    with _UNPACKING:  # pods booting at once for the first time: one unpacks, the rest wait
        if cache.exists():
            return cache
        return _unpack_blank(blank, cache)


def _unpack_blank(blank: Path, cache: Path) -> Path:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    _run(["zstd", "-q", "-d", "--sparse", "-f", "-o", str(tmp), str(blank)], tmp,
         f"the blank data volume {blank} did not unpack")
    os.rename(tmp, cache)
    fsync_dir(cache.parent)
    return cache


def _unpack(blank: Path, disk: Path, size_mib: int) -> None:
    disk.parent.mkdir(parents=True, exist_ok=True)
    unpacked = _unpacked(blank, disk.parent.parent / "blank" / f"{blank.parent.name}.img")
    tmp = disk.with_name(f".{disk.name}.tmp")
    tmp.unlink(missing_ok=True)
    _run(["cp", "--sparse=always", "--reflink=auto", str(unpacked), str(tmp)], tmp,
         f"the blank data volume {unpacked} did not copy")
    if size_mib and tmp.stat().st_size < size_mib << 20:
        os.truncate(tmp, size_mib << 20)  # the guest grows the filesystem to the disk
    os.rename(tmp, disk)
    fsync_dir(disk.parent)


async def ensure_pod_disk(state_dir: Path, pod_id: str, guest_dir: Path, size_mib: int = 0) -> Path:
    """The pod's disk, made from the guest's blank data volume if it is not there yet."""
    disk = pod_disk(state_dir, pod_id)
    if not disk.exists():
        blank = guest_dir / "data.img.zst"
        if not blank.exists():
            why = f"the guest {guest_dir.name} has no data.img.zst"
            raise FeosError(Code.FAILED_PRECONDITION, why)
        await trio.to_thread.run_sync(_unpack, blank, disk, size_mib)
    return disk


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(size)
    os.rename(tmp, path)
    fsync_dir(path.parent)


async def ensure_volume_disk(path: Path, size: int) -> Path:
    if not path.exists():  # noqa: ASYNC240  (a stat: microseconds, not worth a thread)
        await trio.to_thread.run_sync(_sparse, path, size)
    return path


async def remove_pod_disk(state_dir: Path, pod_id: str) -> None:
    disk = pod_disk(state_dir, pod_id)
    await trio.to_thread.run_sync(lambda: disk.unlink(missing_ok=True))
