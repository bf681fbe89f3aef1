"""Record files: one Cap'n Proto message per file, written whole, in the order of the changes.

Theory of operation: a `RecordDir` is a directory of `<id>.pb` files, each one message of one
struct type. A write goes to a temporary file in the directory, is fsync'd, renamed over the
record and the directory is fsync'd: a crash at any point leaves the old record or the new one,
never a torn one. Writes run on one dedicated writer thread per directory, in the order they were
asked for, so two changes of one record land in their order; the caller awaits the write and only
then makes the change visible (or answers its call). At start `load()` reads every record; one
that fails to parse is reported by name and moved aside as `<id>.pb.broken-<time>`, not fatal.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .errors import Code, FeosError

log = logging.getLogger(__name__)

SUFFIX = ".pb"


def write_whole(path: Path, data: bytes) -> None:
    """Write data to path so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def remove_whole(path: Path) -> None:
    """Remove a file so that the removal survives a crash."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer:
    """One thread that runs a directory's writes in the order they were queued."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], None], Callable[[BaseException | None], None]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, done = item
            try:
                work()
            except BaseException as exc:  # handed to the waiting caller
                done(exc)
            else:
                done(None)

    async def run(self, work: Callable[[], None]) -> None:
        """Queue work and wait until it ran; a cancelled wait leaves it to run anyway."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        outcome: list[BaseException | None] = []

        def done(exc: BaseException | None) -> None:
            outcome.append(exc)
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:
                pass

        self._queue.put((work, done))
        await finished.wait()
        if outcome[0] is not None:
            exc = outcome[0]
            if isinstance(exc, OSError):
                raise FeosError(Code.UNAVAILABLE, f"a record could not be written: {exc}") from exc
            raise exc

    def close(self) -> None:
        self._queue.put(None)


class RecordDir:
    """The records of one kind: `<directory>/<id>.pb`, each a message of `struct`."""

    def __init__(self, directory: Path, struct: Any, *, thread_name: str | None = None) -> None:
        self.directory = directory
        self.struct = struct
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = _Writer(thread_name or f"records-{directory.name}")

    def path(self, record_id: str) -> Path:
        return self.directory / f"{record_id}{SUFFIX}"

    async def put(self, record_id: str, value: dict[str, Any]) -> Any:
        """Keep the record; returns once it is on disk, with the message as a reader."""
        message = self.struct.new_message(**value)
        data = message.to_bytes_packed()
        path = self.path(record_id)
        await self._writer.run(lambda: write_whole(path, data))
        return message.as_reader()

    async def remove(self, record_id: str) -> None:
        path = self.path(record_id)
        await self._writer.run(lambda: remove_whole(path))

    def load(self) -> dict[str, dict[str, Any]]:
        """Every record as a dict; broken ones reported and moved aside."""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            record_id = path.name[: -len(SUFFIX)]
            try:
                message = self.struct.from_bytes_packed(path.read_bytes())
                found[record_id] = message.to_dict()
            except Exception as exc:  # any parse failure: the record is unreadable
                aside = path.with_name(f"{path.name}.broken-{int(time.time())}")
                log.error("record %s is unreadable (%s): moved aside to %s", path, exc, aside.name)
                os.rename(path, aside)
        for stale in self.directory.glob(f".*{SUFFIX}.tmp"):
            stale.unlink(missing_ok=True)
        return found

    def close(self) -> None:
        self._writer.close()
