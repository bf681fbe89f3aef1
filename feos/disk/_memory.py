"""Memory snapshots to and from the object store: diskd's pushMemory, pullMemory and the looks
at and the abandon of a transfer in flight (docs/disk.md, "Memory snapshots").

Theory of operation: a transfer is named by its caller (a pod's ID) and runs on a worker thread
(feos.disk._objstore does the chunks, the tries and the checks); while it runs, `transfers`
holds its Progress and its stop event. An abandonMemory, or the call's cancellation (its caller
went away), sets the event: the thread ends at its next chunk with ABORTED, having put no
manifest (a push) or left no file (a pull). One transfer of an ID at a time.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from ..errors import Code, FeosError, invalid
from ._chunks import ChunkCache, unlink_quietly
from ._model import check_digest, check_id
from ._objstore import MemoryManifest, ObjectStore, Progress

log = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.frozen
class Transfer:
    direction: str  # "push" or "pull"
    progress: Progress
    stop: threading.Event


def snapshot_answer(manifest: MemoryManifest) -> dict[str, Any]:
    return {"digest": manifest.digest, "sizeBytes": manifest.size_bytes,
            "chunks": len(manifest.chunks),
            "storedChunks": sum(1 for c in manifest.chunks if c is not None)}  # fmt: skip


class MemoryTransfers:
    """The memory snapshots' pushes and pulls of one diskd."""

    def __init__(self, store: Callable[[], ObjectStore], cache: ChunkCache) -> None:
        self._store = store  # the store, or FAILED_PRECONDITION saying why there is none
        self._cache = cache
        self.transfers: dict[str, Transfer] = {}

    @contextlib.contextmanager
    def _transfer(self, transfer_id: str, direction: str) -> Iterator[Transfer]:
        if transfer_id in self.transfers:
            raise FeosError(Code.ALREADY_EXISTS, f"a memory transfer of {transfer_id} runs")
        transfer = Transfer(direction, Progress(), threading.Event())
        self.transfers[transfer_id] = transfer
        try:
            yield transfer
        finally:
            del self.transfers[transfer_id]

    async def _run(self, transfer: Transfer, work: Callable[[], T]) -> T:
        """work() on a thread; a cancel of the caller stops it (and waits for it no more)."""
        try:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
        except trio.Cancelled:
            transfer.stop.set()
            raise

    async def push(self, transfer_id: str, path: str) -> dict[str, Any]:
        check_id(transfer_id)
        source = Path(path)
        if not source.is_absolute():
            raise invalid("path", f"{path!r} is not an absolute path")
        store = self._store()
        with self._transfer(transfer_id, "push") as transfer:
            manifest = await self._run(transfer, lambda: store.push_memory(
                source, transfer.stop, transfer.progress))  # fmt: skip
        log.info("memory %s: pushed as %s", transfer_id, manifest.digest)
        return {"memory": snapshot_answer(manifest)}

    async def pull(self, transfer_id: str, digest: str, path: str, owner_uid: int
                   ) -> dict[str, Any]:  # fmt: skip
        check_id(transfer_id)
        check_digest(digest)
        dest = Path(path)
        if not dest.is_absolute() or not dest.name or not dest.parent.is_dir():
            raise invalid("path", f"{path!r} is not an absolute path in a directory that exists")
        store = self._store()
        with self._transfer(transfer_id, "pull") as transfer:
            await trio.to_thread.run_sync(_clear_leftovers, dest)
            stop, progress = transfer.stop, transfer.progress
            manifest = await self._run(transfer, lambda: store.pull_memory(
                digest, self._cache, dest, stop, progress, owner_uid))  # fmt: skip
        log.info("memory %s: pulled %s into %s", transfer_id, digest, dest)
        return {"memory": snapshot_answer(manifest)}

    def look(self, transfer_id: str) -> dict[str, Any]:
        transfer = self._running(transfer_id)
        return {"transfer": {"id": transfer_id, "direction": transfer.direction,
                             "bytesDone": transfer.progress.done,
                             "bytesTotal": transfer.progress.total}}  # fmt: skip

    def abandon(self, transfer_id: str) -> dict[str, Any]:
        transfer = self._running(transfer_id)
        transfer.stop.set()
        log.info("memory %s: its %s abandoned", transfer_id, transfer.direction)
        return {}

    def _running(self, transfer_id: str) -> Transfer:
        transfer = self.transfers.get(check_id(transfer_id))
        if transfer is None:
            raise FeosError(Code.NOT_FOUND, f"no memory transfer of {transfer_id} runs")
        return transfer


def _clear_leftovers(dest: Path) -> None:
    """What a pull into `dest` that a kill cut off left beside it (ObjectStore's temporary)."""
    for leftover in dest.parent.glob(f".{glob.escape(dest.name)}.*.tmp"):
        unlink_quietly(leftover)
