"""Record files: one Cap'n Proto message per file, each change kept first in a journal.

Theory of operation: a `RecordDir` is a directory of `<id>.pb` files, each one message of one
struct type, and its journal (feos/_journal.py: `.journal`, a file written whole when it is
made, so that writing into it changes no metadata). A change (a put or a removal) is encoded on
the caller's thread and queued to the directory's writer thread, which keeps changes in groups:
it takes every change queued, appends them to the journal in one write, and syncs it once
(fdatasync: the data and the disk's cache flush). Only then is each change acknowledged. The
folder thread then writes the journal's changes into their files in the background, in the
writer's pauses (or a second's worth at a time under a steady stream: its files' syncs then
seldom delay the journal's): each record's last change in one group commit (the files written
and fsynced, renamed in order, the directory fsynced once: one native call without the GIL,
feos.native.commit_group; a test's instrumented fsync has the same steps made in Python). Once
the folder has caught up the journal starts a new generation, and what it held is no longer
read.

A crash at any point loses nothing that was acknowledged: opening the directory again replays
the journal's entries, in order, over the files (those the folder had not written yet, and the
ones it had, again), writes them into the files and starts a new generation. A torn tail of the
journal (a group whose sync had not returned: never acknowledged) ends it. A record file is
always whole, old or new; the changes of one record land in the order they were queued. While
the directory is open `load()` lays the changes the folder has not written over what the files
hold; other readers of the files (an operator) see them up to a fold behind, and, after a
crash, behind until the next open.

A change is queued from a trio run or from an asyncio loop (the Cap'n Proto thread's, where the
API's creates run without a trip to trio): its home. The writer hands a group's outcome to each
home it came from with one wake-up (trio's `run_sync_soon`, asyncio's `call_soon_threadsafe`);
there the change's `on_kept` runs, then its waiters wake, each on its own loop.

A trio caller waits for its acknowledgement shielded from cancellation (a change that is on its
way to the disk is seen through); an asyncio caller that is cancelled stops waiting, and its
change goes on all the same. Both waits are bounded: a change not kept `within` its bound
(seconds) fails its caller with DEADLINE_EXCEEDED naming the record, and is skipped if the writer
has not reached it yet. A change the journal cannot take fails with the reason: the journal
could not be made (a full disk: ENOSPC), or it is full and the folder cannot write its changes
into their files (RESOURCE_EXHAUSTED on a full disk); what was acknowledged stays in the journal.
At start `load()` reads every record; one that fails to parse is reported by name and moved
aside as `<id>.pb.broken-<time>`, not fatal (a journal with no valid header: `.journal.broken-
<time>`). One RecordDir per directory at a time (feosd's lock sees to that).
"""

from __future__ import annotations

import asyncio
import errno
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
from ._journal import CAPACITY as JOURNAL_BYTES
from ._journal import RESET_AFTER, Entry, Journal, entry_size
from .errors import Code, FeosError

log = logging.getLogger(__name__)

SUFFIX = ".pb"
WRITE_TIMEOUT = 30.0  # a sync behind a snapshot's write-back may take seconds
"""Seconds a record may take to be kept before its caller is told it was not."""
FOLD_IDLE = 0.05
"""Seconds without a new change after which the folder writes the journal's entries into their
files: it folds in the pauses of the writer, whose journal syncs would otherwise queue behind
the files' (a fold's n files cost n syncs, each with the disk's cache flush)."""
FOLD_AFTER_MAX = 1.0
"""Seconds the folder lets entries gather at most, pauses or not (under a steady stream: one
large group a second, a few hundred KiB of the journal's 1 MiB at the most the API keeps)."""
FOLD_RETRY = 0.1
FOLD_RETRY_MAX = 5.0
"""Seconds before a fold that failed is tried again: doubled each time, up to this."""

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


class _Folder:
    """The thread that writes the journal's entries into their record files, in the background.

    It takes every entry not yet folded (the last change of each record among them), commits
    them as one group (feos.native.commit_group: each file written and synced, renamed in order,
    the directory synced once; the same steps in Python with a test's fsync), and only then
    drops them from `pending`: until then `load` lays them over what the files hold. A fold that
    fails is tried again, ever later, and keeps the journal from starting a new generation.
    """

    def __init__(self, directory: Path, dir_fd: int, name: str, fsync: Fsync) -> None:
        self._directory = directory
        self._dir_fd = dir_fd
        self._fsync = fsync
        self._native = fsync is os.fsync and native.can_commit_groups()
        self._serial = itertools.count()
        self._cond = threading.Condition()
        self.pending: list[tuple[int, Entry]] = []  # (the writer's serial, entry), in order
        self.folded = 0  # the serial of the last entry in its file, synced
        self.error: OSError | None = None  # the last fold's failure, until one succeeds
        self._closing = False
        self._hurry = False
        self._first_at = 0.0  # when the oldest entry pending was added (time.monotonic)
        self._last_at = 0.0  # when the newest was
        self.folding = threading.Lock()  # held while the files change; `load` takes it
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, entries: list[tuple[int, Entry]]) -> None:
        now = time.monotonic()
        with self._cond:
            if not self.pending:  # the folder is woken by the first only (then times its wait)
                self._first_at = now
                self._cond.notify_all()
            self._last_at = now
            self.pending.extend(entries)

    def _gather(self) -> None:
        """Under the condition, with entries pending: wait until the writer pauses (FOLD_IDLE
        without a new change), FOLD_AFTER_MAX since the oldest came, the writer hurries the
        folder or the folder closes. Each wait is timed from the two stamps: no wake-up per
        change."""
        while not (self._closing or self._hurry):
            now = time.monotonic()
            left = min(self._last_at + FOLD_IDLE, self._first_at + FOLD_AFTER_MAX) - now
            if left <= 0:
                break
            self._cond.wait(left)
        self._hurry = False

    def unfolded(self) -> list[Entry]:
        with self._cond:
            return [entry for _serial, entry in self.pending]

    def caught_up(self, serial: int, within: float = 0.0) -> bool:
        """Whether every entry up to `serial` is in its file (waiting up to `within` s, or until
        a fold fails)."""
        with self._cond:
            if within > 0 and self.folded < serial:
                self._hurry = True  # the writer waits: no time to let a group gather
                self._cond.notify_all()
            return (
                self._cond.wait_for(
                    lambda: self.folded >= serial or (within > 0 and self.error is not None), within
                )
                and self.folded >= serial
            )

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End the thread once what is pending is folded (or its fold failed: the journal keeps
        it for the next start)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, within: float) -> None:
        """stop, and wait up to `within` s for the thread to end; then its directory is closed."""
        self.stop()
        self._thread.join(within)
        if not self._thread.is_alive() and self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def _loop(self) -> None:
        backoff = FOLD_RETRY
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.pending or self._closing)
                if not self.pending:
                    return
                self._gather()
            error = self.fold_pending()
            if error is None:
                backoff = FOLD_RETRY
                continue
            log.error(
                "records in %s: the journal's changes cannot be written to their files "
                "(%s): tried again in %gs",
                self._directory,
                error,
                backoff,
            )
            with self._cond:
                if self._cond.wait_for(lambda: self._closing, backoff):
                    return  # the journal keeps them: the next start folds them
            backoff = min(2 * backoff, FOLD_RETRY_MAX)

    def fold_pending(self) -> OSError | None:
        with self.folding:
            with self._cond:
                batch = list(self.pending)
            error = self.fold([entry for _serial, entry in batch])
            with self._cond:
                self.error = error
                if error is None:
                    del self.pending[: len(batch)]
                    self.folded = batch[-1][0]
                self._cond.notify_all()
        return error

    def fold(self, entries: list[Entry]) -> OSError | None:
        """Each record's last change among the entries in its file, and the directory synced."""
        last = list({entry.name: entry for entry in entries}.values())
        steps = [
            ("" if e.data is None else f".{e.name}.{next(self._serial)}.tmp", e.name, e.data)
            for e in last
        ]
        if self._native:
            errors, dir_error = native.commit_group(self._dir_fd, steps)
        else:
            errors, dir_error = self._commit_python(steps)
        for (_tmp, name, _data), error in zip(steps, errors, strict=True):
            if error:
                return OSError(error, os.strerror(error), str(self._directory / name))
        if dir_error:
            return OSError(dir_error, os.strerror(dir_error), str(self._directory))
        return None

    def _commit_python(self, steps: list[tuple[str, str, bytes | None]]) -> tuple[list[int], int]:
        """commit_group's steps, one by one, with the test's fsync."""
        errors = [self._stage(tmp, data) for tmp, _name, data in steps]
        for i, (tmp, name, data) in enumerate(steps):
            if not errors[i]:
                errors[i] = self._apply(tmp, name, data)
        try:
            self._fsync(self._dir_fd)
        except OSError as exc:
            return errors, exc.errno or errno.EIO
        return errors, 0

    def _stage(self, tmp: str, data: bytes | None) -> int:
        if data is None:
            return 0
        try:
            _write_synced(self._directory / tmp, data, self._fsync)
        except OSError as exc:
            (self._directory / tmp).unlink(missing_ok=True)
            return exc.errno or errno.EIO
        return 0

    def _apply(self, tmp: str, name: str, data: bytes | None) -> int:
        try:
            if data is None:
                (self._directory / name).unlink(missing_ok=True)
            else:
                os.rename(self._directory / tmp, self._directory / name)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0


class _Writer:
    """One thread that keeps a directory's changes in groups, in the order they were queued:
    each group appended to the journal and synced once, then acknowledged, then handed to the
    folder. The journal starts a new generation when the folder has caught up and more than
    RESET_AFTER bytes of it are used (what a crash leaves to write again is little), or,
    waiting for the folder, when a group does not fit; and at the close, once the folder is done.
    """

    def __init__(self, directory: Path, name: str, fsync: Fsync, capacity: int) -> None:
        self._directory = directory
        self._fsync = fsync
        self._capacity = capacity
        self._sync = os.fdatasync if fsync is os.fsync else fsync
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dir_fd = dir_fd
        self.folder = _Folder(directory, dir_fd, f"{name}-fold", fsync)
        try:
            self._journal = self._recover() or self._made()
        except BaseException:
            os.close(dir_fd)
            raise
        self._appended = 0  # the serial of the last change appended
        self._queue: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.folder.start()
        self._thread.start()

    def _recover(self) -> Journal | None:
        """The journal left by the last run, its entries written into their files (raises
        FeosError if they cannot be: the journal is kept) and a new generation started."""
        found = Journal.recover_or_set_aside(self._directory, self._sync,
                                             f"records in {self._directory}")
        if found is None:
            return None
        journal, entries = found
        try:
            error = self.folder.fold(entries) if entries else None
            if error is not None:
                raise FeosError(
                    Code.UNAVAILABLE,
                    f"records in {self._directory}: {len(entries)} changes of the journal could "
                    f"not be written to their files ({error}); the journal is kept",
                )
            journal.reset(0)
        except BaseException:
            journal.close()
            raise
        return journal

    def _made(self) -> Journal | None:
        """A new journal; None if it cannot be made now (the first change tries again)."""
        try:
            return self._make(self._capacity)
        except OSError as exc:
            log.warning("records in %s: no journal yet (%s)", self._directory, exc)
            return None

    def _make(self, capacity: int) -> Journal:
        return Journal.make(self._directory, self._dir_fd, capacity, self._sync, self._fsync)

    def submit(self, change: Change) -> None:
        self._queue.put(change)

    def close(self, within: float) -> None:
        """End the thread once what is queued is kept, waiting for that (within `within` s): a
        change whose caller went (a create cut by feosd's stop) lands before the process ends;
        then the folder, once it has written what the journal holds into the files."""
        self._queue.put(None)
        if threading.current_thread() is self._thread:
            return
        deadline = time.monotonic() + within
        self._thread.join(within)
        self.folder.close(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() or self.folder.running():
            return  # still at work after the bound: the process's end closes what they hold
        if self._journal is not None:
            self._close_journal(self._journal)
            self._journal = None

    def _close_journal(self, journal: Journal) -> None:
        """Emptied (a new generation) if the files hold all it held, so that the next start has
        nothing to write again; then closed."""
        try:
            if self.folder.caught_up(self._appended):
                journal.reset(0)
        except OSError as exc:
            log.warning("records in %s: the journal is not emptied (%s)", self._directory, exc)
        finally:
            journal.close()

    def _loop(self) -> None:
        try:
            while (group := self._take()) is not None:
                if group:
                    self._commit(group)
        finally:
            self.folder.stop()

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
        if not live:
            return
        entries = [Entry(c.path.name, c.data) for c in live]
        try:
            journal = self._room(sum(entry_size(e.name, e.data) for e in entries))
            journal.append(entries)
        except (OSError, FeosError) as exc:
            for change in live:
                change.settle(exc)
            return
        first = self._appended + 1
        self._appended += len(entries)
        self.folder.add(list(enumerate(entries, first)))
        _settle_kept(live)

    def _given_up(self, change: Change) -> bool:
        if change.abandoned:
            change.settle(FeosError(Code.DEADLINE_EXCEEDED, f"record {change.path}: given up"))
        return change.abandoned

    def _room(self, size: int) -> Journal:
        """The journal, with room for `size` bytes of entries after its last ones."""
        journal = self._journal
        if journal is None:
            journal = self._journal = self._make(max(self._capacity, size))
            return journal
        if journal.fits(size) and not (
            journal.used > RESET_AFTER and self.folder.caught_up(self._appended)
        ):
            return journal
        if not self.folder.caught_up(self._appended, WRITE_TIMEOUT):
            raise self._full()
        journal.reset(size)
        return journal

    def _full(self) -> FeosError:
        error = self.folder.error
        if error is None:
            return FeosError(
                Code.UNAVAILABLE,
                f"records in {self._directory}: the journal is "
                f"full and its changes were not written to their files in time",
            )
        code = Code.RESOURCE_EXHAUSTED if error.errno == errno.ENOSPC else Code.UNAVAILABLE
        return FeosError(
            code,
            f"records in {self._directory}: the journal is full and its "
            f"changes cannot be written to their files ({error})",
        )


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
        journal_bytes: int = JOURNAL_BYTES,
    ) -> None:
        self.directory = directory
        self.struct = struct
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = _Writer(
            directory, thread_name or f"records-{directory.name}", fsync, journal_bytes
        )

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
        """Every record as a dict: its file, or its change in the journal not yet written there
        (the folder waits meanwhile); broken files reported and moved aside."""
        folder = self._writer.folder
        with folder.folding:
            found = self._read_files()
            pending = folder.unfolded()
        for entry in pending:
            record_id = entry.name[: -len(SUFFIX)]
            if entry.data is None:
                found.pop(record_id, None)
            else:
                found[record_id] = self.struct.from_bytes_packed(entry.data).to_dict()
        return found

    def _read_files(self) -> dict[str, dict[str, Any]]:
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
