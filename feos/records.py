"""Record files: one Cap'n Proto message per file, written whole, in the order of the changes.

Theory of operation: a `RecordDir` is a directory of `<id>.pb` files, each one message of one
struct type. A change (a put or a removal) is encoded on the caller's thread and queued to the
directory's one writer thread, which commits in groups: it takes every change queued, writes
each put's temporary file (their write-back started together) and fsyncs each, then, in queue
order, renames each over its record or unlinks the removed one, and fsyncs the directory ONCE for
the group. Only then is each change acknowledged. The group's steps are one native call without
the GIL (feos.native.commit_group); a test's instrumented fsync has them made here in Python.
A crash at any point leaves each record old or new, never torn, and nothing that was
acknowledged is lost; the changes of one record land in the order they were queued.

A change is queued from a trio run or from an asyncio loop (the Cap'n Proto thread's, where the
API's creates run without a trip to trio): its home. The writer hands a group's outcome to each
home it came from with one wake-up (trio's `run_sync_soon`, asyncio's `call_soon_threadsafe`);
there the change's `on_kept` runs, then its waiters wake, each on its own loop.

A trio caller waits for its acknowledgement shielded from cancellation (a change that is on its
way to the disk is seen through); an asyncio caller that is cancelled stops waiting, and its
change goes on all the same. Both waits are bounded: a change not kept `within` its bound
(seconds) fails its caller with DEADLINE_EXCEEDED naming the record, and is skipped if the writer
has not reached it yet. At start `load()` reads every record; one that fails to parse is reported
by name and moved aside as `<id>.pb.broken-<time>`, not fatal.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from . import native
from .errors import Code, FeosError

log = logging.getLogger(__name__)

SUFFIX = ".pb"
WRITE_TIMEOUT = 30.0  # a sync behind a snapshot's write-back may take seconds
"""Seconds a record may take to be kept before its caller is told it was not."""

Fsync = Callable[[int], None]


def write_whole(path: Path, data: bytes) -> None:
    """Write data to path so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_synced(tmp, data, os.fsync)
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


def is_directory_fd(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def _write_synced(path: Path, data: bytes, fsync: Fsync) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fsync(fd)
    finally:
        os.close(fd)


class _Home:
    """Where a change's outcome is heard: the trio run or the asyncio loop of the thread that
    queued it (or waits for it). `post` hands a function to it from any thread; `key` is the
    run's token or the loop, the same for every change of that thread."""

    key: object

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        raise NotImplementedError

    async def wait(self, change: Change, within: float) -> None:
        raise NotImplementedError


class _TrioHome(_Home):
    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.key = self._token = token

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass  # the run has ended: nobody waits any more

    async def wait(self, change: Change, within: float) -> None:
        """Shielded (a change on its way to the disk is seen through) but bounded."""
        event = trio.Event()
        if change._add_waiter(self, event.set):
            with trio.CancelScope(shield=True), trio.move_on_after(within):
                await event.wait()


class _AsyncioHome(_Home):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.key = self._loop = loop

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop has closed: nobody waits any more

    async def wait(self, change: Change, within: float) -> None:
        """Bounded. A caller cancelled here stops waiting; its change goes on all the same."""
        loop = self._loop
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        if change._add_waiter(self, wake):
            timer = loop.call_later(within, wake)
            try:
                await woken
            finally:
                timer.cancel()


def _here() -> _Home:
    """The home of the calling thread: its trio run, else its running asyncio loop."""
    if trio.lowlevel.in_trio_run():
        return _TrioHome(trio.lowlevel.current_trio_token())
    return _AsyncioHome(asyncio.get_running_loop())


_outcomes = threading.Lock()
"""Keeps a change's settling and a waiter's joining whole when they are on two threads."""


class Change:
    """One queued put (`data`) or removal (`data is None`) of the record at `path`.

    `on_kept` runs on the thread that queued the change (its home: a trio run, or the Cap'n Proto
    thread's asyncio loop) when the change is kept, before any waiter wakes, in the order the
    writer kept that home's changes: what memory mirrors of the records follows the disk.
    """

    def __init__(self, path: Path, data: bytes | None, on_kept: Callable[[], None]) -> None:
        self.path = path
        self.data = data
        self.on_kept = on_kept
        self.abandoned = False  # its caller gave up: the writer skips it if not begun
        self.tmp: Path | None = None  # a put's temporary file, once the writer made it
        self.error: BaseException | None = None
        self.done = False  # kept or failed: set on its home, read anywhere
        self._home = _here()
        self._waiters: list[tuple[_Home, Callable[[], None]]] = []

    def settle(self, error: BaseException | None) -> None:
        """On the writer thread: hand the outcome to the change's home."""
        self._home.post(self._settled, error)

    def _settled(self, error: BaseException | None) -> None:
        self.error = error
        if error is None:
            self.on_kept()
        with _outcomes:
            self.done = True
            waiters, self._waiters = self._waiters, []
        for home, wake in waiters:
            if home.key is self._home.key:
                wake()
            else:
                home.post(wake)

    def _add_waiter(self, home: _Home, wake: Callable[[], None]) -> bool:
        """False if the change is already settled (there is nothing to wait for)."""
        with _outcomes:
            if self.done:
                return False
            self._waiters.append((home, wake))
            return True

    async def wait(self, within: float) -> None:
        """Until the change is kept, within `within` seconds; raises FeosError if not.

        Waits on the caller's own loop (trio's, or asyncio's on the Cap'n Proto thread)."""
        if not self.done:
            await _here().wait(self, within)
        if not self.done:
            self.abandoned = True
            raise FeosError(
                Code.DEADLINE_EXCEEDED,
                f"record {self.path} was not kept within {within:g}s (a write begun may land)",
            )
        if isinstance(self.error, FeosError):
            raise self.error
        if self.error is not None:
            raise FeosError(
                Code.UNAVAILABLE, f"record {self.path} could not be kept: {self.error}"
            ) from self.error


def _settle_kept(changes: list[Change]) -> None:
    """Acknowledge a group with one wake-up of each home it came from, in its order."""
    by_home: dict[object, tuple[_Home, list[Change]]] = {}
    for change in changes:
        by_home.setdefault(change._home.key, (change._home, []))[1].append(change)
    for home, group in by_home.values():
        home.post(_kept_all, group)


def _kept_all(changes: list[Change]) -> None:
    for change in changes:
        change._settled(None)


class _Writer:
    """One thread that commits a directory's changes in groups, in the order they were queued.

    With the default fsync and feos._native built, a group's steps are one native call, made
    without the GIL (feos.native.commit_group); otherwise (a test's instrumented fsync) they are
    made here one by one, in the same order.
    """

    def __init__(self, directory: Path, name: str, fsync: Fsync) -> None:
        self._directory = directory
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fsync = fsync
        self._native = fsync is os.fsync and native.can_commit_groups()
        self._serial = itertools.count()
        self._queue: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, change: Change) -> None:
        self._queue.put(change)

    def close(self, within: float) -> None:
        """End the thread once what is queued is kept, waiting for that (within `within` s): a
        change whose caller went (a create cut by feosd's stop) lands before the process ends."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(within)

    def _loop(self) -> None:
        try:
            while (group := self._take()) is not None:
                if group:
                    self._commit(group)
        finally:
            os.close(self._dir_fd)

    def _take(self) -> list[Change] | None:
        """Every change queued (waiting for the first); None once closed."""
        first = self._queue.get()
        if first is None:
            return None
        group = [first]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return group
            if item is None:
                self._commit(group)
                return None
            group.append(item)

    def _commit(self, group: list[Change]) -> None:
        live = [c for c in group if not self._given_up(c)]
        for change in live:
            if change.data is not None:
                change.tmp = change.path.with_name(
                    f".{change.path.name}.{next(self._serial)}.tmp"
                )
        applied = self._commit_native(live) if self._native else self._commit_python(live)
        if applied:
            _settle_kept(applied)

    def _given_up(self, change: Change) -> bool:
        if change.abandoned:
            change.settle(FeosError(Code.DEADLINE_EXCEEDED, f"record {change.path}: given up"))
        return change.abandoned

    def _commit_native(self, changes: list[Change]) -> list[Change]:
        """The group's steps in one call; the changes applied and their directory synced."""
        errors, dir_error = native.commit_group(
            self._dir_fd,
            [("" if c.tmp is None else c.tmp.name, c.path.name, c.data) for c in changes],
        )
        applied = []
        for change, error in zip(changes, errors, strict=True):
            if error:
                change.settle(OSError(error, os.strerror(error), str(change.path)))
            else:
                applied.append(change)
        return self._settle_dir_error(applied, dir_error)

    def _commit_python(self, changes: list[Change]) -> list[Change]:
        staged = [c for c in changes if self._stage(c)]
        applied = [c for c in staged if self._apply(c)]
        if not applied:
            return []
        try:
            self._fsync(self._dir_fd)
        except OSError as exc:
            return self._settle_dir_error(applied, exc.errno or 0, exc)
        return applied

    def _settle_dir_error(
        self, applied: list[Change], error: int, exc: OSError | None = None
    ) -> list[Change]:
        """The changes whose directory was synced: all, or none (each told why)."""
        if not error:
            return applied
        failure = exc or OSError(error, os.strerror(error), str(self._directory))
        for change in applied:
            change.settle(failure)
        return []

    def _stage(self, change: Change) -> bool:
        """A put's temporary file, written and synced; False (and settled) if that failed."""
        if change.tmp is None:
            return True
        try:
            _write_synced(change.tmp, change.data or b"", self._fsync)
        except OSError as exc:
            change.tmp.unlink(missing_ok=True)
            change.settle(exc)
            return False
        return True

    def _apply(self, change: Change) -> bool:
        try:
            if change.tmp is None:
                change.path.unlink(missing_ok=True)
            else:
                os.rename(change.tmp, change.path)
        except OSError as exc:
            change.settle(exc)
            return False
        return True


class RecordDir:
    """The records of one kind: `<directory>/<id>.pb`, each a message of `struct`.

    `fsync` is what syncs a file or the directory (os.fsync; tests count the calls).
    """

    def __init__(
        self,
        directory: Path,
        struct: Any,
        *,
        thread_name: str | None = None,
        fsync: Fsync = os.fsync,
    ) -> None:
        self.directory = directory
        self.struct = struct
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = _Writer(directory, thread_name or f"records-{directory.name}", fsync)

    def path(self, record_id: str) -> Path:
        return self.directory / f"{record_id}{SUFFIX}"

    def submit_put(
        self, record_id: str, value: dict[str, Any], on_kept: Callable[[Any], None]
    ) -> Change:
        """Queue the record's new value; on_kept(reader) runs once it is on disk."""
        message = self.struct.new_message()
        for field, field_value in value.items():  # a third of new_message(**value)'s cost
            setattr(message, field, field_value)
        reader = message.as_reader()
        change = Change(self.path(record_id), message.to_bytes_packed(), lambda: on_kept(reader))
        self._writer.submit(change)
        return change

    def submit_remove(self, record_id: str, on_kept: Callable[[], None]) -> Change:
        change = Change(self.path(record_id), None, on_kept)
        self._writer.submit(change)
        return change

    async def put(
        self, record_id: str, value: dict[str, Any], *, within: float = WRITE_TIMEOUT
    ) -> Any:
        """Keep the record; returns once it is on disk, with the message as a reader."""
        readers: list[Any] = []
        await self.submit_put(record_id, value, readers.append).wait(within)
        return readers[0]

    async def remove(self, record_id: str, *, within: float = WRITE_TIMEOUT) -> None:
        await self.submit_remove(record_id, lambda: None).wait(within)

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
        for stale in self.directory.glob(f".*{SUFFIX}*.tmp"):
            stale.unlink(missing_ok=True)
        return found

    def close(self, *, within: float = WRITE_TIMEOUT) -> None:
        """Stop the writer, once the changes queued are kept (waits for them, bounded)."""
        self._writer.close(within)
