"""DiskService: diskd's API (schema/disk.capnp) over its files and its data paths.

Theory of operation. The records on disk are the truth; `layers` and `disks` mirror them and
are replaced whole when a change is kept. A change of one disk runs under that disk's lock (a
create, start, stop, delete or bake of the same ID waits for the one before); a layer is made
under the layers' lock. Blocking steps (qemu-img, zstd, hashing, fsync) run on worker threads.

A disk is stopped or started. Started for QEMU, nothing runs: QEMU opens the qcow2 top and the
chain beneath it itself. Started for Firecracker, a qemu-storage-daemon exports the chain as a
raw FUSE file (feos.disk._export); its pid is in the disk's record, and `recover` adopts it at
diskd's start, or starts it again where it died while diskd was away.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from .._digest import sha256_file
from ..errors import Code, FeosError, invalid
from . import _export
from ._chunks import ChunkCache
from ._files import Files, allocated
from ._lazy import LazyMemory
from ._memory import MemoryTransfers
from ._model import (
    EMPTY_DIGEST,
    Disk,
    Layer,
    check_digest,
    check_id,
    check_kind,
    check_vmm,
    collectable,
    disk_answer,
    disks_on,
    size_for,
    stack,
)
from ._objstore import LayerManifest, ObjectStore

log = logging.getLogger(__name__)

VERSION = "0.1.0"
NO_STORE = "diskd has no object store: "


def _text(params: dict[str, Any], name: str) -> str:
    value = params.get(name, "")
    if not isinstance(value, str):
        raise invalid(name, "must be a string")
    return value


def _number(params: dict[str, Any], name: str) -> int:
    value = params.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(name, "must be an integer")
    return value


class DiskService:
    def __init__(self, state_dir: Path, *, guests: Callable[[], Iterable[str]], guest_dir: Path,
                 store: ObjectStore | None, store_reason: str, cache: ChunkCache) -> None:
        self.files = Files(state_dir)
        self.state_dir = state_dir
        self._guests = guests  # the guest versions installed: their L0s are never collected
        self._guest_dir = guest_dir
        self._store = store
        self._store_reason = store_reason
        self._cache = cache
        self.layers: dict[str, Layer] = {}
        self.disks: dict[str, Disk] = {}
        self._disk_locks: dict[str, trio.Lock] = {}
        self._layers_lock = trio.Lock()
        self._stops: dict[str, set[threading.Event]] = {}  # the pushes in flight, by digest
        self.memory = MemoryTransfers(self._need_store, cache)
        self.lazy = LazyMemory(state_dir / "memory", self._need_store, cache)

    # -- start -------------------------------------------------------------------------------

    async def recover(self) -> None:
        """The records loaded, what a crash left half made cleared, every started disk served
        again: an export found running is adopted, one that died is started anew."""
        await trio.to_thread.run_sync(self._load)
        for disk in list(self.disks.values()):
            if disk.exported:
                await self._recover_export(disk)
        await trio.to_thread.run_sync(self.lazy.recover)

    def _load(self) -> None:
        self.files.prepare()
        self.files.clear_leftovers()
        self.files.ensure_empty()
        self.layers = self.files.load_layers()
        self.disks = self.files.load_disks()

    async def _recover_export(self, disk: Disk) -> None:
        directory = self.files.disk_dir(disk.id)
        if _export.alive(directory, disk.data_path_pid):
            log.info("disk %s: adopted its export (pid %d)", disk.id, disk.data_path_pid)
            return
        log.warning("disk %s: its export (pid %d) ended while diskd was away: serving it again",
                    disk.id, disk.data_path_pid)
        pid = await _export.start(directory, disk.top, disk.top_format, disk.owner_uid)
        await self._keep(attrs.evolve(disk, data_path_pid=pid))

    def _lock(self, disk_id: str) -> trio.Lock:
        return self._disk_locks.setdefault(disk_id, trio.Lock())

    async def _keep(self, disk: Disk) -> Disk:
        try:
            await trio.to_thread.run_sync(self.files.keep_disk, disk)
        except OSError as exc:
            code = Code.RESOURCE_EXHAUSTED if exc.errno == errno.ENOSPC else Code.INTERNAL
            raise FeosError(code, f"disk {disk.id}: its record was not written: "
                            f"{exc.strerror}") from exc
        self.disks = {**self.disks, disk.id: disk}
        return disk

    def _disk(self, disk_id: str) -> Disk:
        disk = self.disks.get(check_id(disk_id))
        if disk is None:
            raise FeosError(Code.NOT_FOUND, f"diskd has no disk {disk_id}")
        return disk

    def _answer(self, disk: Disk) -> dict[str, Any]:
        directory = self.files.disk_dir(disk.id)
        path = directory / (_export.EXPORT if disk.exported else disk.top)
        answer = disk_answer(disk, str(path))
        answer["allocatedBytes"] = allocated(directory / disk.top)
        return answer

    def _layer_answer(self, layer: Layer) -> dict[str, Any]:
        return layer.answer(disks_on([layer.digest], self.disks.values())[layer.digest])

    # -- the API: looks ------------------------------------------------------------------------

    async def info(self, params: dict[str, Any]) -> dict[str, Any]:
        stats = self._cache.stats()
        store: dict[str, Any] = {"configured": False, "reason": self._store_reason}
        if self._store is not None:
            config = self._store.config
            store = {"configured": True, "bucket": config.bucket, "endpoint": config.endpoint}
        return {"info": {
            "version": VERSION, "pid": os.getpid(), "stateDir": str(self.state_dir),
            "store": store,
            "cache": {"limitBytes": stats.limit_bytes, "usedBytes": stats.used_bytes,
                      "chunks": stats.chunks, "evictedChunks": stats.evicted_chunks},
            "ublk": ublk_status(),
        }}

    async def get_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"disk": self._answer(self._disk(_text(params, "id")))}

    async def list_disks(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"disks": [self._answer(d) for _, d in sorted(self.disks.items())]}

    async def list_layers(self, params: dict[str, Any]) -> dict[str, Any]:
        counts = disks_on(self.layers, self.disks.values())
        return {"layers": [layer.answer(counts[d]) for d, layer in sorted(self.layers.items())]}

    # -- layers --------------------------------------------------------------------------------

    async def import_layer(self, params: dict[str, Any]) -> dict[str, Any]:
        path, guest = Path(_text(params, "path")), _text(params, "guest")
        if not path.is_absolute() or not path.is_file():  # noqa: ASYNC240  (a stat)
            raise invalid("path", f"{str(path)!r} is not an absolute path of a file")
        async with self._layers_lock:
            layer = await trio.to_thread.run_sync(self._import, path, guest)
            self.layers = {**self.layers, layer.digest: layer}
        return {"layer": self._layer_answer(layer)}

    def _import(self, path: Path, guest: str) -> Layer:
        """An L0 from a raw image or its .zst. A .zst's layer is named by the .zst's digest: a
        guest's blank volume is gigabytes of zeroes that hash for seconds, its .zst in
        milliseconds, and the .zst is what the object store would move (docs/disk.md)."""
        digest = sha256_file(path)
        have = self.layers.get(digest)
        if have is not None:
            return have
        if path.name.endswith(".zst"):
            tmp = self.files.unpack(path, digest)
        else:
            tmp = self.files.copy_in(path, digest.replace(":", "-"))
        st = os.stat(tmp)
        layer = Layer(digest, "", "raw", st.st_blocks * 512, st.st_size, guest=guest,
                      created_unix_ns=time.time_ns())
        log.info("layer %s: imported from %s (%d bytes)", digest, path, st.st_size)
        return self.files.register(tmp, layer)

    # -- disks ---------------------------------------------------------------------------------

    async def create_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id, kind = check_id(_text(params, "id")), check_kind(_text(params, "kind"))
        base_digest = _text(params, "base") or EMPTY_DIGEST
        check_digest(base_digest, "base")
        asked = _number(params, "sizeBytes")
        async with self._lock(disk_id):
            found = self.disks.get(disk_id)
            if found is not None:
                if found.kind != kind or (found.layers and found.base != base_digest):
                    raise FeosError(Code.ALREADY_EXISTS,
                                    f"disk {disk_id} exists as a {found.kind} on "
                                    f"{found.base or 'a plain file'}")
                return {"disk": self._answer(found)}
            layers = stack(self.layers, base_digest)
            base = self.layers[base_digest]
            disk = Disk(disk_id, kind, size_for(base, asked), "top.qcow2", "qcow2", layers,
                        created_unix_ns=time.time_ns())
            await trio.to_thread.run_sync(self.files.make_disk, disk, base)
            self.disks = {**self.disks, disk_id: disk}
            log.info("disk %s: made on %s", disk_id, base_digest)
        return {"disk": self._answer(disk)}

    async def adopt_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id, kind = check_id(_text(params, "id")), check_kind(_text(params, "kind"))
        path = Path(_text(params, "path"))
        async with self._lock(disk_id):
            found = self.disks.get(disk_id)
            if found is not None:
                if path.exists() and found.layers:  # noqa: ASYNC240  (a stat)
                    raise FeosError(Code.ALREADY_EXISTS,
                                    f"disk {disk_id} exists on layers; {path} is another")
                if path.exists():  # noqa: ASYNC240  (a crash after the rename: one inode)
                    await trio.to_thread.run_sync(path.unlink)
                return {"disk": self._answer(found)}
            if not path.is_absolute() or not path.is_file():  # noqa: ASYNC240
                raise FeosError(Code.NOT_FOUND, f"no plain file {path} to take over")
            size = path.stat().st_size  # noqa: ASYNC240
            disk = Disk(disk_id, kind, size, "top.raw", "raw", (),
                        created_unix_ns=time.time_ns())
            await trio.to_thread.run_sync(self.files.adopt, disk, path)
            self.disks = {**self.disks, disk_id: disk}
            log.info("disk %s: took over the plain file %s", disk_id, path)
        return {"disk": self._answer(disk)}

    async def start_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id, vmm = check_id(_text(params, "id")), check_vmm(_text(params, "vmm"))
        owner = _number(params, "ownerUid")
        async with self._lock(disk_id):
            disk = self._disk(disk_id)
            if disk.state == "started":
                if (disk.vmm, disk.owner_uid) != (vmm, owner):
                    raise FeosError(Code.FAILED_PRECONDITION,
                                    f"disk {disk_id} is started for {disk.vmm} as user "
                                    f"{disk.owner_uid}")
                if not disk.exported or _export.alive(self.files.disk_dir(disk_id),
                                                      disk.data_path_pid):
                    return {"disk": self._answer(disk)}
            pid = 0
            if vmm == "firecracker":
                pid = await _export.start(self.files.disk_dir(disk_id), disk.top,
                                          disk.top_format, owner)
            started = attrs.evolve(disk, state="started", vmm=vmm, owner_uid=owner,
                                   data_path_pid=pid)
            try:
                disk = await self._keep(started)
            except FeosError:
                if pid:  # not recorded: not left serving either
                    await _export.stop(self.files.disk_dir(disk_id), pid)
                raise
        return {"disk": self._answer(disk)}

    async def stop_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id = check_id(_text(params, "id"))
        async with self._lock(disk_id):
            disk = await self._stop(self._disk(disk_id))
        return {"disk": self._answer(disk)}

    async def _stop(self, disk: Disk) -> Disk:
        if disk.state != "started":
            return disk
        if disk.vmm == "firecracker":
            await _export.stop(self.files.disk_dir(disk.id), disk.data_path_pid)
        return await self._keep(attrs.evolve(disk, state="stopped", vmm="", owner_uid=0,
                                             data_path_pid=0))

    async def delete_disk(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id = check_id(_text(params, "id"))
        async with self._lock(disk_id):
            disk = self._disk(disk_id)
            await self._stop(disk)
            await trio.to_thread.run_sync(self.files.remove_disk, disk_id)
            self.disks = {k: v for k, v in self.disks.items() if k != disk_id}
            log.info("disk %s: deleted", disk_id)
        return {}

    # -- bake, and the object store ------------------------------------------------------------

    async def bake(self, params: dict[str, Any]) -> dict[str, Any]:
        disk_id, image = check_id(_text(params, "id")), _text(params, "image")
        async with self._lock(disk_id):
            disk = self._disk(disk_id)
            if not disk.layers:
                raise FeosError(Code.FAILED_PRECONDITION,
                                f"disk {disk_id} is a plain file taken over: no layer to bake on")
            async with self._layers_lock:
                layer = await trio.to_thread.run_sync(self._seal, disk, image)
                self.layers = {**self.layers, layer.digest: layer}
        return {"layer": self._layer_answer(layer)}

    def _seal(self, disk: Disk, image: str) -> Layer:
        """A copy of the top (a reflink where the filesystem has them) as a layer on its base:
        its backing name is the base's file name already, which resolves in layers/ too."""
        top = self.files.disk_dir(disk.id) / disk.top
        tmp = self.files.copy_in(top, f"bake-{disk.id}")
        digest = sha256_file(tmp)
        have = self.layers.get(digest)
        if have is not None:
            tmp.unlink()
            return have
        layer = Layer(digest, disk.base, "qcow2", allocated(tmp), disk.size_bytes,
                      guest=self.layers[disk.base].guest if disk.base in self.layers else "",
                      image=image, created_unix_ns=time.time_ns())
        log.info("layer %s: baked of disk %s (%s)", digest, disk.id, image)
        return self.files.register(tmp, layer)

    def _need_store(self) -> ObjectStore:
        if self._store is None:
            raise FeosError(Code.FAILED_PRECONDITION, NO_STORE + self._store_reason)
        return self._store

    async def push(self, params: dict[str, Any]) -> dict[str, Any]:
        """The layer and those beneath it, parents first, but the L0s: every node makes those
        from the guest it has installed (a layer's digest names its guest's data.img.zst)."""
        digest = check_digest(_text(params, "digest"))
        store = self._need_store()
        for below in reversed(stack(self.layers, digest)):
            layer = self.layers[below]
            if not layer.parent or layer.pushed:
                continue
            path = self.files.layer_path(below)
            with self._stoppable(digest) as stop:
                await trio.to_thread.run_sync(store.push_layer, path, _manifest(layer), stop)
            pushed = attrs.evolve(layer, pushed=True)
            await trio.to_thread.run_sync(self.files.record_layer, pushed)
            self.layers = {**self.layers, below: pushed}
            log.info("layer %s: pushed", below)
        return {"layer": self._layer_answer(self.layers[digest])}

    @contextlib.contextmanager
    def _stoppable(self, digest: str) -> Iterator[threading.Event]:
        """A push of `digest` that `abort` may end (push_layer's stop: ABORTED)."""
        stop = threading.Event()
        self._stops.setdefault(digest, set()).add(stop)
        try:
            yield stop
        finally:
            self._stops[digest].discard(stop)
            if not self._stops[digest]:
                del self._stops[digest]

    async def abort(self, params: dict[str, Any]) -> dict[str, Any]:
        digest = check_digest(_text(params, "digest"))
        stops = self._stops.get(digest, set())
        for stop in stops:
            stop.set()
        if stops:
            log.info("push of %s: aborted (%d in flight)", digest, len(stops))
        return {"aborted": len(stops)}

    async def put_checkpoint(self, params: dict[str, Any]) -> dict[str, Any]:
        body = params.get("body", b"")
        if not isinstance(body, bytes) or not body:
            raise invalid("body", "must be a checkpoint's bytes")
        ref = await trio.to_thread.run_sync(self._need_store().put_checkpoint, body)
        log.info("checkpoint %s: put (%d bytes)", ref, len(body))
        return {"ref": ref}

    async def get_checkpoint(self, params: dict[str, Any]) -> dict[str, Any]:
        ref = check_digest(_text(params, "ref"), "ref")
        body = await trio.to_thread.run_sync(self._need_store().get_checkpoint, ref)
        return {"body": body}

    async def pull(self, params: dict[str, Any]) -> dict[str, Any]:
        """The layer and those beneath it that diskd lacks; an L0 from its guest's install."""
        digest = check_digest(_text(params, "digest"))
        wanted = digest
        while wanted and wanted not in self.layers:
            store = self._need_store()
            async with self._layers_lock:
                if wanted not in self.layers:
                    layer = await self._pull_one(store, wanted)
                    self.layers = {**self.layers, wanted: layer}
            wanted = self.layers[wanted].parent
        return {"layer": self._layer_answer(self.layers[digest])}

    async def _pull_one(self, store: ObjectStore, digest: str) -> Layer:
        try:
            manifest = await trio.to_thread.run_sync(
                store.pull_layer, digest, self._cache, self.files.layers)
        except FeosError as exc:
            if exc.code is not Code.NOT_FOUND:
                raise
            return await self._guest_l0(digest, exc)
        layer = Layer(digest, manifest.parent, manifest.format, manifest.size_bytes,
                      manifest.virtual_bytes, guest=manifest.guest, image=manifest.image,
                      pushed=True, created_unix_ns=manifest.created_unix_ns)
        await trio.to_thread.run_sync(self.files.record_layer, layer)
        log.info("layer %s: pulled", digest)
        return layer

    async def _guest_l0(self, digest: str, missing: FeosError) -> Layer:
        """An L0 the store does not hold: the blank data volume of an installed guest, if one's
        data.img.zst is it."""
        for version in await trio.to_thread.run_sync(lambda: list(self._guests())):
            blank = self._guest_dir / version / "data.img.zst"
            if blank.exists() and await trio.to_thread.run_sync(sha256_file, blank) == digest:
                return await trio.to_thread.run_sync(self._import, blank, version)
        raise FeosError(Code.NOT_FOUND, f"{missing.message}, nor is it the blank data volume of "
                        "a guest installed here")

    # -- collect -------------------------------------------------------------------------------

    async def collect(self, params: dict[str, Any]) -> dict[str, Any]:
        async with self._layers_lock:
            guests = await trio.to_thread.run_sync(lambda: list(self._guests()))
            doomed = collectable(self.layers, self.disks.values(), guests)
            freed = 0
            for digest in doomed:  # children before their parents
                freed += await trio.to_thread.run_sync(self.files.remove_layer, digest)
                self.layers = {k: v for k, v in self.layers.items() if k != digest}
                log.info("layer %s: collected", digest)
            evicted, cache_freed = await trio.to_thread.run_sync(self._cache.evict)
        return {"layersRemoved": len(doomed), "chunksEvicted": evicted,
                "bytesFreed": freed + cache_freed}


    # -- memory snapshots ----------------------------------------------------------------------

    async def push_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        return await self.memory.push(_text(params, "id"), _text(params, "path"))

    async def pull_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        return await self.memory.pull(_text(params, "id"), _text(params, "digest"),
                                      _text(params, "path"), _number(params, "ownerUid"))

    async def memory_transfer(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.memory.look(_text(params, "id"))

    async def abandon_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.memory.abandon(_text(params, "id"))

    async def serve_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        server_id, digest = check_id(_text(params, "id")), check_digest(_text(params, "digest"))
        path = Path(_text(params, "socket"))
        if not path.is_absolute() or not path.parent.is_dir():
            raise invalid("socket", f"{str(path)!r} is not an absolute path in a directory "
                          "that exists")
        owner = _number(params, "ownerUid")
        server = await trio.to_thread.run_sync(self.lazy.serve, server_id, digest, path, owner)
        return {"server": server.answer()}

    async def fill_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        server = self.lazy.get(check_id(_text(params, "id")))
        await trio.to_thread.run_sync(server.fill, abandon_on_cancel=True)
        return {"server": server.answer()}

    async def get_memory_server(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"server": self.lazy.get(check_id(_text(params, "id"))).answer()}

    async def stop_memory(self, params: dict[str, Any]) -> dict[str, Any]:
        await trio.to_thread.run_sync(self.lazy.stop, check_id(_text(params, "id")))
        return {}


def _manifest(layer: Layer) -> LayerManifest:
    return LayerManifest(digest=layer.digest, parent=layer.parent, size_bytes=layer.size_bytes,
                         virtual_bytes=layer.virtual_bytes, guest=layer.guest, image=layer.image,
                         format=layer.format, created_unix_ns=layer.created_unix_ns)


def ublk_status() -> str:
    """Why the ublk data path does not run here (docs/disk.md, "ublk")."""
    if not Path("/dev/ublk-control").exists():
        return ("unavailable: the kernel has no ublk_drv (/dev/ublk-control is missing); "
                "disks are served as qcow2 chains (QEMU) and FUSE exports (Firecracker)")
    return ("unavailable: diskd's ublk I/O loop is not built; its control structures are in "
            "feos.native (docs/disk.md)")
