"""Hibernate and restore: a pod into the object store as a checkpoint, and back (docs/pods.md).

Theory of operation. A hibernation is a change of the pod (a task of the service's nursery under
the pod's lock, which its callers only wait for: a second HibernatePod joins the one in flight).
It goes through phases that PodInfo.hibernation names, each an event of the pod:

    suspend   a running pod is suspended (its memory in the microVM's snapshot file, its disks
              stopped); a stopped pod has no memory and hibernates on its disks alone
    seal      diskd seals the pod disk's top, and each volume's, as a layer (bake)
    upload    diskd pushes those layers and the memory file into the object store
    commit    the checkpoint (checkpoint.py's JSON: the spec, the layers, the memory, the guest
              and VMM it ran on) is put into the store under its digest: the commit point
    release   the pod is HIBERNATED with the checkpoint's reference in its record, its volumes
              CHECKPOINTED, its network taken back, its microVM and disks removed from the node

Until the commit point the node still holds everything of the pod (the snapshot, the disks): a
ResumePod then abandons the hibernation (the phase's diskd push is aborted: ABORTED) and resumes
the pod from its snapshot, unless the hibernation was asked with no_abandon or has no memory; a
failure (the store refusing a PUT) likewise resumes a pod that ran and answers the store's
message. From the commit point on, a Resume waits for the hibernation and restores the pod.
A feosd killed before the commit finds the pod SUSPENDED (or STOPPED) with its files; killed
after it, finds it HIBERNATED and finishes the release (`finish_release`).

A restore (ResumePod of a HIBERNATED pod, or RestorePod of a checkpoint made elsewhere) fetches
the checkpoint (its digest checked), refuses one whose guest or VMM version is not installed
(FAILED_PRECONDITION), pulls the layers (every chunk checked), makes the disks on them and, for a
checkpoint with memory, fetches the memory whole (QEMU's file migration takes no userfaultfd
handler) and makes the microVM SUSPENDED on it. What a failed restore made is removed again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import Code, FeosError
from . import _lifecycle as lc
from ._bringup import BringUp
from ._disks import DiskdPort, PodDisks, pod_disk
from ._netface import NetworkFace
from ._pod import Pod
from ._ports import MicroVmsPort, Volumes
from ._spec import parse_spec
from ._volumes import Volume

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "feos-checkpoint/1"
HIBERNATE_S = 3600.0
"""A hibernation: the suspend, the seals, every byte of the pod into the store, the release."""
RESTORE_S = 3600.0
PHASES = ("suspend", "seal", "upload", "commit", "release")
PROGRESS_S = 0.5


@attrs.define(eq=False)
class Progress:
    """A hibernation in flight, as PodInfo.hibernation answers it."""

    no_abandon: bool
    phase: str = "suspend"
    done: int = 0
    total: int = 0
    memory: bool = True
    committed: bool = False
    abandoned: bool = False
    pushing: str = ""  # the layer diskd pushes now, for an abandon's abort
    pushing_memory: bool = False
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def abandonable(self) -> bool:
        return not (self.no_abandon or self.committed or not self.memory)

    def answer(self) -> dict[str, Any]:
        return {"phase": self.phase, "bytesDone": self.done, "bytesTotal": self.total,
                "noAbandon": self.no_abandon, "committed": self.committed}


@attrs.frozen
class SavedVolume:
    id: str
    layer: str
    size_bytes: int
    formatted: bool


@attrs.frozen
class Checkpoint:
    """What the object store keeps of a hibernated pod besides its layers and memory."""

    pod_id: str
    spec: dict[str, Any]
    guest_version: str
    driver: str
    vmm: str  # the VMM's version the memory was written by; "" without memory
    disk: str  # the pod disk's layer
    disk_bytes: int
    volumes: tuple[SavedVolume, ...] = ()
    memory: str = ""  # the memory's reference in the store; "": a stopped pod's
    memory_bytes: int = 0
    disk_origin: str = ""  # the pod's `disk` (what its disk was first made on)
    created_unix_ns: int = 0

    def to_json(self) -> bytes:
        record = attrs.asdict(self)
        record["format"] = CHECKPOINT_FORMAT
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes, ref: str) -> Checkpoint:
        """DATA_LOSS naming what is wrong with a checkpoint that is not one of ours."""
        try:
            record = json.loads(body)
            if record.pop("format") != CHECKPOINT_FORMAT:
                raise ValueError("not a checkpoint of this format")
            volumes = tuple(SavedVolume(**v) for v in record.pop("volumes"))
            checkpoint = cls(volumes=volumes, **record)
            parse_spec(checkpoint.spec)
        except FeosError as exc:
            raise FeosError(Code.DATA_LOSS, f"checkpoint {ref}: its spec: {exc.message}") from None
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FeosError(Code.DATA_LOSS, f"checkpoint {ref} is not valid: {exc}") from None
        return checkpoint

    def layers(self) -> list[str]:
        return [self.disk, *(v.layer for v in self.volumes)]


class Hibernator:
    """The hibernations and restores of the pod service's pods (their changes call these)."""

    def __init__(self, state_dir: Path, vms: MicroVmsPort, volumes: Volumes, *,
                 diskd: DiskdPort | None, disks: PodDisks, network: NetworkFace,
                 bringup: BringUp, apply: Callable[[Pod, str, str], Awaitable[bool]],
                 keep: Callable[[Pod], Awaitable[None]],
                 tell: Callable[[Pod, str], None]) -> None:  # fmt: skip
        self._state_dir = state_dir
        self._vms = vms
        self._volumes = volumes
        self._diskd = diskd
        self._disks = disks
        self._net = network
        self._bringup = bringup
        self._apply = apply
        self._keep = keep
        self._tell = tell  # an event of the pod naming a phase

    def _need(self) -> DiskdPort:
        if self._diskd is None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            "feosd has no diskd: pods cannot be hibernated or restored")
        return self._diskd

    def _phase(self, pod: Pod, progress: Progress, phase: str) -> None:
        progress.phase = phase
        self._tell(pod, f"hibernation: {phase}")

    # -- hibernate ---------------------------------------------------------------------------

    async def hibernate(self, pod: Pod, progress: Progress, *,
                        suspend: Callable[[Pod], Awaitable[None]],
                        resume: Callable[[Pod], Awaitable[None]]) -> None:  # fmt: skip
        """Under the pod's lock. Abandoned: ABORTED, the pod left SUSPENDED for its Resume."""
        if pod.state == lc.HIBERNATED:
            return
        if pod.state != lc.RUNNING:
            lc.next_state(pod.state, "hibernate", pod.id)
        diskd = self._need()
        ran = pod.state == lc.RUNNING
        if ran:
            self._phase(pod, progress, "suspend")
            await suspend(pod)
        progress.memory = pod.state == lc.SUSPENDED
        try:
            with progress.scope:
                checkpoint = await self._upload(diskd, pod, progress)
            if progress.abandoned:
                raise _abandoned(pod, progress)
            self._phase(pod, progress, "commit")
            progress.committed = True
            ref = (await diskd.call("putCheckpoint", body=checkpoint.to_json()))["ref"]
        except FeosError as exc:
            if progress.abandoned:
                raise _abandoned(pod, progress) from None
            log.warning("pod %s: the hibernation failed: %s", pod.id, exc.message)
            self._tell(pod, f"hibernation failed: {exc.message}")
            if ran:
                await resume(pod)
            raise FeosError(exc.code, f"pod {pod.id}: the hibernation failed: {exc.message}"
                            + ("; it runs on" if ran else "")) from None
        pod.checkpoint = ref
        await self._apply(pod, "hibernate", f"checkpoint {ref}")
        self._phase(pod, progress, "release")
        await self._release(pod, checkpoint)

    async def _upload(self, diskd: DiskdPort, pod: Pod, progress: Progress) -> Checkpoint:
        self._phase(pod, progress, "seal")
        sealed = (await diskd.call("bake", id=pod.id, image=""))["layer"]
        volumes = []
        for volume_id in pod.spec.volume_ids():
            layer = (await diskd.call("bake", id=volume_id, image=""))["layer"]
            volume = self._volumes.store.get(volume_id)
            assert volume is not None  # claimed by the pod
            volumes.append((SavedVolume(volume_id, layer["digest"], volume.size_bytes,
                                        volume.formatted), layer))  # fmt: skip
        memory = self._vms.snapshot_file(pod.id) if progress.memory else None
        memory_bytes = memory.stat().st_size if memory is not None else 0
        layers = [sealed, *(layer for _, layer in volumes)]
        progress.total = sum(int(x.get("sizeBytes", 0)) for x in layers) + memory_bytes
        self._phase(pod, progress, "upload")
        for layer in layers:
            progress.pushing = layer["digest"]
            await diskd.call("push", digest=layer["digest"])
            progress.done += int(layer.get("sizeBytes", 0))
        progress.pushing = ""
        memory_ref = ""
        if memory is not None:
            memory_ref = await self._push_memory(diskd, pod, progress, memory)
            progress.done += memory_bytes
        vmm = self._vms.vmm_version(pod.driver or None) if memory is not None else ""
        return Checkpoint(
            pod_id=pod.id, spec=pod.spec.to_dict(), guest_version=pod.guest_version,
            driver=pod.driver or self._vms.driver_for(pod.id), vmm=vmm, disk=sealed["digest"],
            disk_bytes=pod.spec.disk_size_mib << 20, volumes=tuple(v for v, _ in volumes),
            memory=memory_ref, memory_bytes=memory_bytes, disk_origin=pod.disk,
            created_unix_ns=time.time_ns(),
        )  # fmt: skip

    async def _push_memory(self, diskd: DiskdPort, pod: Pod, progress: Progress,
                           memory: Path) -> str:  # fmt: skip
        """diskd's pushMemory, its progress (memoryTransfer) looked at twice a second."""
        base = progress.done
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                while True:
                    await trio.sleep(PROGRESS_S)
                    try:
                        transfer = (await diskd.call("memoryTransfer", id=pod.id,
                                                     wait=False))["transfer"]
                    except FeosError:
                        continue
                    progress.done = base + int(transfer.get("bytesDone", 0))

            nursery.start_soon(follow)
            progress.pushing_memory = True
            try:
                pushed = await diskd.call("pushMemory", id=pod.id, path=str(memory))
            except FeosError as exc:
                failed: FeosError | None = exc  # raised below: not in the nursery's group
            else:
                failed = None
            finally:
                progress.pushing_memory = False
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        progress.done = base
        digest: str = pushed["memory"]["digest"]
        return digest

    async def abandon(self, pod: Pod, progress: Progress) -> None:
        """A Resume came before the commit point: the push in flight aborted, the rest cut."""
        progress.abandoned = True
        calls = []
        if progress.pushing:
            calls.append(("abort", {"digest": progress.pushing}))
        if progress.pushing_memory:
            calls.append(("abandonMemory", {"id": pod.id}))
        for method, params in calls:
            try:
                await self._need().call(method, wait=False, **params)
            except FeosError as exc:
                log.info("pod %s: %s of its push: %s", pod.id, method, exc.message)
        progress.scope.cancel()

    async def _release(self, pod: Pod, checkpoint: Checkpoint) -> None:
        """What the node held of a hibernated pod goes; idempotent (a restart finishes it)."""
        await self._volumes.checkpointed(pod.id, {v.id: v.layer for v in checkpoint.volumes})
        await self._vms.delete(pod.id)
        await self._net.remove(pod)
        self._net.changed()
        await self._disks.delete(pod.id, pod_disk(self._state_dir, pod.id))
        for volume in checkpoint.volumes:
            await self._disks.delete(volume.id, self._volumes.disk_path(volume.id))
        pod.ipv6 = pod.ipv4 = ""
        await self._keep(pod)

    async def finish_release(self, pod: Pod) -> None:
        """A feosd that starts again: a HIBERNATED pod's release, which a restart may have cut."""
        try:
            checkpoint = await self.fetch(pod.checkpoint)
            await self._release(pod, checkpoint)
        except FeosError as exc:
            log.error("pod %s: what the node held of it after its hibernation was not removed: "
                      "%s", pod.id, exc.message)  # fmt: skip

    # -- restore -----------------------------------------------------------------------------

    async def fetch(self, ref: str) -> Checkpoint:
        body = (await self._need().call("getCheckpoint", ref=ref))["body"]
        return Checkpoint.from_json(body, ref)

    def check_runnable(self, checkpoint: Checkpoint) -> None:
        """FAILED_PRECONDITION: the snapshot's VMM version is not the one installed here."""
        if not checkpoint.memory:
            return
        have = self._vms.vmm_version(checkpoint.driver)
        if have != checkpoint.vmm:
            raise FeosError(Code.FAILED_PRECONDITION, f"the checkpoint's memory was written by "
                            f"{checkpoint.vmm}; this node has {have}")  # fmt: skip

    async def take(self, pod: Pod, checkpoint: Checkpoint) -> None:
        """RestorePod: a checkpoint made elsewhere becomes this node's HIBERNATED pod."""
        volumes = [Volume(v.id, v.size_bytes, (), pod_id=pod.id, formatted=v.formatted,
                          checkpoint=v.layer) for v in checkpoint.volumes]  # fmt: skip
        await self._volumes.take_checkpointed(pod.id, volumes)
        pod.checkpoint = pod.checkpoint or ""
        pod.guest_version, pod.driver, pod.disk = (checkpoint.guest_version, checkpoint.driver,
                                                   checkpoint.disk_origin)

    async def restore(self, pod: Pod) -> None:
        """Under the pod's lock: HIBERNATED to SUSPENDED (memory) or STOPPED (disks alone)."""
        checkpoint = await self.fetch(pod.checkpoint)
        self.check_runnable(checkpoint)
        diskd = self._need()
        made: list[tuple[str, Path]] = []
        memory = self._state_dir / "restore" / f"{pod.id}.memory"
        try:
            self._tell(pod, "restore: disks")
            await self._make_disks(diskd, pod, checkpoint, made)
            if checkpoint.memory:
                await self._make_vm(diskd, pod, checkpoint, memory)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(60):
                await self._undo(pod, made, memory)
            raise
        for volume in checkpoint.volumes:
            await self._volumes.opened(volume.id)
        ref, pod.checkpoint = pod.checkpoint, ""
        event = "restore-memory" if checkpoint.memory else "restore-disks"
        await self._apply(pod, event, f"restored from checkpoint {ref}")

    async def _make_disks(self, diskd: DiskdPort, pod: Pod, checkpoint: Checkpoint,
                          made: list[tuple[str, Path]]) -> None:  # fmt: skip
        disks = [(pod.id, "pod", checkpoint.disk_bytes, checkpoint.disk,
                  pod_disk(self._state_dir, pod.id))]
        disks += [(v.id, "volume", v.size_bytes, v.layer, self._volumes.disk_path(v.id))
                  for v in checkpoint.volumes]
        for disk_id, kind, size, layer, plain in disks:
            await diskd.call("pull", digest=layer)
            await self._disks.delete(disk_id, plain)  # a disk left of an earlier attempt
            made.append((disk_id, plain))
            await diskd.call("createDisk", id=disk_id, kind=kind, sizeBytes=size, base=layer)

    async def _make_vm(self, diskd: DiskdPort, pod: Pod, checkpoint: Checkpoint,
                       memory: Path) -> None:  # fmt: skip
        self._tell(pod, "restore: memory")
        memory.parent.mkdir(parents=True, exist_ok=True)
        await diskd.call("pullMemory", id=pod.id, digest=checkpoint.memory, path=str(memory),
                         ownerUid=0)
        pod.guest_version, pod.driver = checkpoint.guest_version, checkpoint.driver
        if await self._net.allocate(pod):
            await self._keep(pod)
        spec = await self._bringup.vm_spec(pod)
        await self._vms.restore(pod.id, spec, guest_version=checkpoint.guest_version,
                                driver=checkpoint.driver, memory=memory)
        await self._disks.stop([pod.id, *pod.spec.volume_ids()])  # the resume starts them

    async def _undo(self, pod: Pod, made: list[tuple[str, Path]], memory: Path) -> None:
        await self._vms.delete(pod.id)
        await self._net.remove(pod)
        pod.ipv6 = pod.ipv4 = ""
        for disk_id, plain in made:
            try:
                await self._disks.delete(disk_id, plain, wait=False)
            except FeosError as exc:
                log.warning("disk %s of a failed restore stays: %s", disk_id, exc.message)
        memory.unlink(missing_ok=True)  # noqa: ASYNC240  (a memory file pullMemory left)


def _abandoned(pod: Pod, progress: Progress) -> FeosError:
    return FeosError(Code.ABORTED, f"pod {pod.id}: its hibernation was abandoned by a resume "
                     f"in its {progress.phase}")
