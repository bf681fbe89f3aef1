"""The pods' and the volumes' disks, which diskd serves (docs/disk.md): feosd's side.

A pod's disk is diskd's disk of the pod's ID, made at its first bring-up on the L0 of the guest
it boots (the guest's data.img.zst imported as a layer, once per guest version) and kept across
stops until the pod is deleted; a volume's is diskd's disk of the volume's ID on the volumes'
empty L0, made at its first boot and removed with the volume. A disk is started for the pod's
VMM before a boot or a resume and stopped after a stop, a crash or a suspend of its microVM.

Plain files from before diskd (<state>/disk/pods/<id>.img, <state>/volumes/<id>.disk) are
taken over by diskd (adoptDisk: moved, never copied) at feosd's start and, should that not have
run yet, by the bring-up that needs them.

Where a disk is needed, feosd waits for diskd up to two minutes (a diskd restarting), then the
bring-up fails with UNAVAILABLE naming diskd. A stop does not wait: a disk that could not be
stopped is logged and stopped by its next start's answer or its delete.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from ..errors import Code, FeosError

log = logging.getLogger(__name__)

Choose = Callable[[str], Awaitable[str]]  # the guest's L0 -> the layer a new pod disk is made on


class DiskdPort(Protocol):
    """diskd's API as feosd calls it (feos.disk.Diskd)."""

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]: ...


@attrs.frozen
class DiskFile:
    """What the VMM opens: a path in a format, and the layers' files a qcow2 top stands on."""

    path: str
    format: str
    chain: tuple[str, ...] = ()


def pod_disk(state_dir: Path, pod_id: str) -> Path:
    """A pod's plain file from before diskd."""
    return state_dir / "disk" / "pods" / f"{pod_id}.img"


class PodDisks:
    def __init__(self, state_dir: Path, diskd: DiskdPort | None) -> None:
        self._state_dir = state_dir
        self._diskd = diskd
        self._l0: dict[Path, str] = {}  # a guest's data.img.zst: its layer's digest

    @property
    def serving(self) -> bool:
        return self._diskd is not None

    def _need(self) -> DiskdPort:
        if self._diskd is None:
            raise FeosError(Code.UNAVAILABLE, "feosd has no diskd to serve the pods' disks")
        return self._diskd

    async def _get(self, disk_id: str) -> dict[str, Any] | None:
        try:
            disk: dict[str, Any] = (await self._need().call("getDisk", id=disk_id))["disk"]
            return disk
        except FeosError as exc:
            if exc.code is Code.NOT_FOUND:
                return None
            raise

    async def _base(self, guest_dir: Path) -> str:
        blank = guest_dir / "data.img.zst"
        digest = self._l0.get(blank)
        if digest is None:
            if not blank.exists():
                why = f"the guest {guest_dir.name} has no data.img.zst"
                raise FeosError(Code.FAILED_PRECONDITION, why)
            layer = await self._need().call("importLayer", path=str(blank), guest=guest_dir.name)
            digest = self._l0[blank] = layer["layer"]["digest"]
        return digest

    async def _ensure(self, disk_id: str, kind: str, plain: Path, size: int, base: str | None,
                      guest_dir: Path | None, choose: Choose | None = None) -> bool:
        """The disk in diskd, made or taken over if it is not there; True if made now."""
        if await self._get(disk_id) is not None:
            return False
        if plain.exists():  # noqa: ASYNC240  (a stat)
            await self._need().call("adoptDisk", id=disk_id, kind=kind, path=str(plain))
            return False
        if guest_dir is not None:
            base = await self._base(guest_dir)
            if choose is not None:  # a layer baked of the pod's image instead (feos.pods._bake)
                base = await choose(base)
        await self._need().call("createDisk", id=disk_id, kind=kind, sizeBytes=size,
                                base=base or "")
        return True

    async def _start(self, disk_id: str, vmm: str) -> DiskFile:
        # ownerUid 0: the microVM layer gives the file to the microVM's own user (and back), as
        # it does for every disk it links into the microVM's directory.
        disk = (await self._need().call("startDisk", id=disk_id, vmm=vmm, ownerUid=0))["disk"]
        return DiskFile(disk["path"], disk["format"], tuple(disk.get("chain", ())))

    async def pod(self, pod_id: str, guest_dir: Path, size_bytes: int, vmm: str,
                  choose: Choose | None = None) -> tuple[DiskFile, bool]:
        """The pod's disk started for `vmm`; and whether it was made now (no containers yet)."""
        made = await self._ensure(pod_id, "pod", pod_disk(self._state_dir, pod_id), size_bytes,
                                  None, guest_dir, choose)
        return await self._start(pod_id, vmm), made

    async def volume(self, volume_id: str, plain: Path, size_bytes: int, vmm: str) -> DiskFile:
        await self._ensure(volume_id, "volume", plain, size_bytes, "", None)
        return await self._start(volume_id, vmm)

    async def start(self, disk_ids: Iterable[str], vmm: str) -> None:
        """Before a resume: every disk of the pod served again, as it was."""
        for disk_id in disk_ids:
            await self._start(disk_id, vmm)

    async def stop(self, disk_ids: Iterable[str]) -> None:
        """After the microVM ended or was suspended: each disk flushed and its data path ended."""
        if self._diskd is None:
            return
        for disk_id in disk_ids:
            try:
                await self._diskd.call("stopDisk", id=disk_id, wait=False)
            except FeosError as exc:
                if exc.code is not Code.NOT_FOUND:
                    log.warning("disk %s was not stopped: %s", disk_id, exc.message)

    async def delete(self, disk_id: str, plain: Path, *, wait: bool = True) -> None:
        """The disk gone (a delete that comes again finds nothing), and its plain file if any;
        `wait` False: UNAVAILABLE at once if diskd does not answer (a caller holding a lock)."""
        if self._diskd is not None:
            try:
                await self._diskd.call("deleteDisk", id=disk_id, wait=wait)
            except FeosError as exc:
                if exc.code is not Code.NOT_FOUND:
                    raise
        if plain.exists():  # noqa: ASYNC240  (a stat)
            await trio.to_thread.run_sync(lambda: plain.unlink(missing_ok=True))

    async def adopt_plain_files(self, pods: Iterable[str], volumes: dict[str, Path]) -> None:
        """At feosd's start: the kept pods' and volumes' plain files taken over by diskd."""
        found = [(p, "pod", pod_disk(self._state_dir, p)) for p in pods]
        found += [(v, "volume", path) for v, path in volumes.items()]
        for disk_id, kind, path in found:
            if not path.exists():
                continue
            try:
                await self._need().call("adoptDisk", id=disk_id, kind=kind, path=str(path))
                log.info("%s %s: its plain file %s is diskd's now", kind, disk_id, path)
            except FeosError as exc:
                log.error("%s %s: diskd did not take %s over: %s", kind, disk_id, path,
                          exc.message)
