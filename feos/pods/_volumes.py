"""VolumeService: disks that outlive the pods they are attached to.

A volume is recorded at creation (AVAILABLE); its disk is made at its first boot. A pod claims
its volumes all or none (ATTACHED to it) and its deletion lets them go (AVAILABLE again). A
volume's disk is diskd's disk of the volume's ID on the volumes' empty L0 (feos.pods._disks);
<state-dir>/volumes/<id>.disk is its plain file from before diskd, which diskd takes over.
DeleteVolume deletes its disk first: a volume whose disk diskd could not delete stays.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from .. import _schema
from .._codec import NoParams, takes
from .._store import Store
from ..errors import Code, FeosError, invalid
from ..records import RecordDir
from ..rpc import on_rpc_thread

MIB = 1 << 20
MIN_SIZE = 64 * MIB
MAX_SIZE = 16 << 40
MAX_LABELS = 64

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?")

AVAILABLE, ATTACHED, CHECKPOINTED = "available", "attached", "checkpointed"


@attrs.frozen
class Volume:
    id: str
    size_bytes: int
    labels: tuple[tuple[str, str], ...]
    state: str = AVAILABLE
    pod_id: str = ""
    formatted: bool = False
    created_unix_ns: int = 0
    checkpoint: str = ""  # while CHECKPOINTED: its layer in the object store

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "sizeBytes": self.size_bytes,
            "labels": [{"key": k, "value": v} for k, v in self.labels],
            "state": self.state,
            "podId": self.pod_id,
            "formatted": self.formatted,
            "createdUnixNs": self.created_unix_ns,
            "checkpoint": self.checkpoint,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Volume:
        return cls(
            id=data["id"],
            size_bytes=data.get("sizeBytes", 0),
            labels=tuple((lb["key"], lb.get("value", "")) for lb in data.get("labels", [])),
            state=data.get("state", AVAILABLE),
            pod_id=data.get("podId", ""),
            formatted=data.get("formatted", False),
            created_unix_ns=data.get("createdUnixNs", 0),
            checkpoint=data.get("checkpoint", ""),
        )


def check_volume_id(value: object, field: str = "id") -> str:
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise invalid(field, "must be a lowercase UUID (8-4-4-4-12 hex digits)")
    return value


def check_size(value: object) -> int:
    if not isinstance(value, int) or value < MIN_SIZE or value > MAX_SIZE or value % MIB:
        raise invalid("sizeBytes", "must be from 64 MiB to 16 TiB in whole MiB")
    return value


def check_labels(labels: Sequence[Label]) -> tuple[tuple[str, str], ...]:
    if len(labels) > MAX_LABELS:
        raise invalid("labels", f"at most {MAX_LABELS}")
    seen: dict[str, str] = {}
    for i, label in enumerate(labels):
        key, value = label.key, label.value
        if not _LABEL_KEY.fullmatch(key):
            raise invalid(
                f"labels[{i}].key",
                "must be 1 to 63 of a-z, 0-9, ., _, / and -, "
                "starting and ending with a letter or digit",
            )
        if len(value) > 256:
            raise invalid(f"labels[{i}].value", "at most 256 characters")
        if key in seen:
            raise invalid(f"labels[{i}].key", f"{key} is given twice")
        seen[key] = value
    return tuple(sorted(seen.items()))


# -- the calls' params, structured and checked at the API's edge (feos._codec.takes) ----------


@attrs.frozen
class Label:
    key: str = ""
    value: str = ""


def _checked(check: Callable[[Any], object]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator of one of the check_ functions (which raise INVALID_ARGUMENT)."""

    def validate(_instance: Any, _attribute: Any, value: Any) -> None:
        check(value)

    return validate


@attrs.frozen
class CreateVolume:
    id: str = attrs.field(default="", validator=_checked(check_volume_id))
    size_bytes: int = attrs.field(default=0, validator=_checked(check_size))
    labels: tuple[Label, ...] = attrs.field(default=(), validator=_checked(check_labels))

    def label_pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((label.key, label.value) for label in self.labels))


@attrs.frozen
class VolumeId:
    id: str = attrs.field(default="", validator=_checked(check_volume_id))


def _label_pairs(answer: Any) -> tuple[tuple[str, str], ...]:
    return tuple((label.key, label.value) for label in answer.labels)  # kept sorted


def _exists_otherwise(volume_id: str) -> FeosError:
    return FeosError(Code.ALREADY_EXISTS, f"volume {volume_id} exists with another size or labels")


class DiskDeleter(Protocol):
    async def delete(self, disk_id: str, plain: Path, *, wait: bool = True) -> None: ...


class VolumeService:
    def __init__(self, state_dir: Path, records: RecordDir | None = None) -> None:
        self.directory = state_dir / "volumes"
        self.disks: DiskDeleter | None = None  # the pod service's (feos.pods._disks.PodDisks)
        self.store: Store[Volume] = Store(
            records
            or RecordDir(self.directory, _schema.volume().Volume, thread_name="volume-records"),
            Volume.to_dict,
            Volume.from_dict,
            self._answer,
        )
        # What the API answers: each volume as a Cap'n Proto reader. A change sets or drops one
        # key in place (copying the mapping made each create cost the number of volumes); a
        # read on the RPC thread is one step under the GIL (a get) or holds the lock (a list),
        # so it sees the mapping before a change or after it, never during.
        self._answers: dict[str, Any] = {}
        self._answering = threading.Lock()  # two threads change it: their steps stay whole

    def load(self) -> None:
        self.store.load()
        struct = _schema.volume().Volume
        self._answers = {v.id: struct.new_message(**v.to_dict()).as_reader() for v in self.store}

    def disk_path(self, volume_id: str) -> Path:
        return self.directory / f"{volume_id}.disk"

    def _get(self, volume_id: str) -> Volume:
        volume = self.store.get(volume_id)
        if volume is None:
            raise FeosError(Code.NOT_FOUND, f"volume {volume_id} does not exist")
        return volume

    def _answer(self, volume_id: str, reader: Any) -> None:
        """Once a change is kept: the record's reader in the answers (on the thread of the
        change: trio's, or the Cap'n Proto thread's for a create)."""
        with self._answering:
            if reader is None:
                self._answers.pop(volume_id, None)
            else:
                self._answers[volume_id] = reader

    async def _keep(self, volume: Volume) -> None:
        await self.store.put(volume.id, volume)

    # -- the API ---------------------------------------------------------------------------

    @on_rpc_thread
    @takes(CreateVolume)
    async def create_volume(self, call: CreateVolume) -> dict[str, Any]:
        """Runs on the Cap'n Proto thread under the API, without the trip to trio and back (in
        trio where a trio caller calls it): it awaits nothing but its record, whose outcome the
        writer hands to the loop it runs on. It only adds a volume that is not there, and trio's
        changes only touch volumes that are, so the two need no common lock."""
        volume_id, size, labels = call.id, call.size_bytes, call.label_pairs()
        answer = self._answers.get(volume_id)
        if answer is not None:  # kept already: the same create again, or another one
            if answer.sizeBytes != size or _label_pairs(answer) != labels:
                raise _exists_otherwise(volume_id)
            return {"volume": answer}
        found = self.store.pending(volume_id)
        if found is None:
            volume = Volume(volume_id, size, labels, created_unix_ns=time.time_ns())
            found = self.store.stage(volume_id, volume)
        elif found.value.size_bytes != size or found.value.labels != labels:
            raise _exists_otherwise(volume_id)
        await self.store.kept(found)  # concurrent creates share the writer's syncs
        return {"volume": self._answers[volume_id]}

    @on_rpc_thread
    @takes(VolumeId)
    def get_volume(self, call: VolumeId) -> dict[str, Any]:
        answer = self._answers.get(call.id)
        if answer is None:
            raise FeosError(Code.NOT_FOUND, f"volume {call.id} does not exist")
        return {"volume": answer}

    @on_rpc_thread
    @takes(NoParams)
    def list_volumes(self, call: NoParams) -> dict[str, Any]:
        with self._answering:  # a list is many steps: none of the changes' among them
            volumes = list(self._answers.values())
        return {"volumes": volumes}

    @takes(VolumeId)
    async def delete_volume(self, call: VolumeId) -> dict[str, Any]:
        volume_id = call.id
        async with self.store.lock:
            volume = self._get(volume_id)
            if volume.pod_id:
                raise FeosError(
                    Code.FAILED_PRECONDITION,
                    f"volume {volume_id} is {volume.state} to pod {volume.pod_id}",
                )
            path = self.disk_path(volume_id)
            if self.disks is not None:  # under the volumes' lock: diskd is not waited for
                await self.disks.delete(volume_id, path, wait=False)
            else:
                await trio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
            await self.store.remove(volume_id)
        return {}

    # -- for the pod service ---------------------------------------------------------------

    async def claim(self, pod_id: str, volume_ids: Sequence[str]) -> None:
        """Attach every volume to the pod, or none: each must exist and be another pod's not."""
        async with self.store.lock:
            for volume_id in volume_ids:
                volume = self.store.get(volume_id)
                if volume is None:
                    raise FeosError(
                        Code.FAILED_PRECONDITION, f"volume {volume_id} is not on this node"
                    )
                if volume.pod_id and volume.pod_id != pod_id:
                    raise FeosError(
                        Code.FAILED_PRECONDITION,
                        f"volume {volume_id} is attached to pod {volume.pod_id}",
                    )
            for volume_id in volume_ids:
                volume = self._get(volume_id)
                if volume.state == CHECKPOINTED and volume.pod_id == pod_id:
                    continue  # opened from its checkpoint at its pod's next boot
                if volume.pod_id != pod_id or volume.state != ATTACHED:
                    await self._keep(attrs.evolve(volume, state=ATTACHED, pod_id=pod_id))

    async def release(self, pod_id: str) -> None:
        """Let go of every volume the pod has: AVAILABLE again (a checkpointed one stays so)."""
        async with self.store.lock:
            for volume in self.store:
                if volume.pod_id == pod_id and volume.state == ATTACHED:
                    await self._keep(attrs.evolve(volume, state=AVAILABLE, pod_id=""))

    async def checkpointed(self, pod_id: str, layers: dict[str, str]) -> None:
        """A hibernation's commit: each volume's data is the layer named, in the object store."""
        async with self.store.lock:
            for volume_id, layer in layers.items():
                volume = self._get(volume_id)
                await self._keep(attrs.evolve(volume, state=CHECKPOINTED, pod_id=pod_id,
                                              checkpoint=layer))

    async def take_checkpointed(self, pod_id: str, volumes: Sequence[Volume]) -> None:
        """A checkpoint made elsewhere: its volumes recorded here, CHECKPOINTED to its pod.
        FAILED_PRECONDITION: one of the IDs is here already, another pod's or with other data."""
        async with self.store.lock:
            for volume in volumes:
                have = self.store.get(volume.id)
                if have is not None and (have.pod_id != pod_id or have.state == AVAILABLE):
                    raise FeosError(Code.FAILED_PRECONDITION,
                                    f"volume {volume.id} is on this node already")
            for volume in volumes:
                if self.store.get(volume.id) is None:
                    await self._keep(attrs.evolve(volume, state=CHECKPOINTED, pod_id=pod_id))

    async def forget_checkpointed(self, pod_id: str) -> None:
        """A restore that failed: the volumes it took over from the checkpoint go again."""
        async with self.store.lock:
            for volume in list(self.store):
                if volume.pod_id == pod_id and volume.state == CHECKPOINTED:
                    await self.store.remove(volume.id)

    async def opened(self, volume_id: str) -> None:
        """Its disk was made on its checkpoint again: ATTACHED."""
        async with self.store.lock:
            volume = self._get(volume_id)
            if volume.state == CHECKPOINTED:
                await self._keep(attrs.evolve(volume, state=ATTACHED, checkpoint=""))

    async def mark_formatted(self, volume_id: str) -> None:
        async with self.store.lock:
            volume = self.store.get(volume_id)
            if volume is not None and not volume.formatted:
                await self._keep(attrs.evolve(volume, formatted=True))

    def close(self) -> None:
        self.store.close()
