"""Record files: round trips, order, and what a crash or a broken file leaves."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from feos import _journal, _schema, native
from feos import records as records_module
from feos._journal import Entry
from feos._store import Store
from feos.errors import Code, FeosError
from feos.records import RecordDir, is_directory_fd, write_whole

T = TypeVar("T")

labels = st.lists(
    st.fixed_dictionaries({"key": st.text(min_size=1, max_size=20), "value": st.text(max_size=40)}),
    max_size=5,
)
volumes = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=40),
        "sizeBytes": st.integers(min_value=0, max_value=2**64 - 1),
        "labels": labels,
        "state": st.sampled_from(["available", "attached", "checkpointed"]),
        "podId": st.text(max_size=20),
        "formatted": st.booleans(),
        "createdUnixNs": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    }
)


@settings(max_examples=60, deadline=None)
@given(value=volumes)
def test_a_record_reads_back_as_written(tmp_path_factory, value) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("records")

    async def main() -> dict:  # type: ignore[type-arg]
        records = RecordDir(directory, _schema.volume().Volume)
        try:
            await records.put("one", value)
            return records.load()
        finally:
            records.close()

    loaded = trio.run(main)
    expected = {k: v for k, v in value.items() if not (k == "labels" and v == [])}
    assert {k: v for k, v in loaded["one"].items() if not (k == "labels" and v == [])} == expected


async def test_writes_land_in_their_order(tmp_path: Path) -> None:
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        async with trio.open_nursery() as nursery:
            for size in range(1, 51):
                # Queued in order from one task: the last one asked for is what stays.
                nursery.start_soon(records.put, "v", {"id": "v", "sizeBytes": size})
                await trio.lowlevel.checkpoint()
        assert records.load()["v"]["sizeBytes"] == 50
    finally:
        records.close()


async def test_remove_and_a_broken_record_set_aside(tmp_path: Path) -> None:
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        await records.put("a", {"id": "a"})
        await records.put("b", {"id": "b"})
        await records.remove("a")
        (tmp_path / "c.pb").write_bytes(b"\x01\x02")
        (tmp_path / ".d.pb.tmp").write_bytes(b"half a write")
        loaded = records.load()
        assert set(loaded) == {"b"}
        assert list(tmp_path.glob("c.pb.broken-*"))
        assert not (tmp_path / ".d.pb.tmp").exists()
    finally:
        records.close()


def test_a_failed_write_leaves_the_old_record(tmp_path: Path) -> None:
    path = tmp_path / "r.pb"
    write_whole(path, b"old")
    os.chmod(tmp_path, 0o500)
    try:
        if os.geteuid() == 0:
            # root writes anyway: make the temporary name a directory instead, so the open fails
            os.chmod(tmp_path, 0o700)
            (tmp_path / ".r.pb.tmp").mkdir()
        try:
            write_whole(path, b"new")
        except OSError:
            pass
        else:
            raise AssertionError("the write should have failed")
    finally:
        os.chmod(tmp_path, 0o700)
    assert path.read_bytes() == b"old"


# -- group commit, order, deadlines, crash safety ------------------------------------------------


def sync_kind(fd: int) -> str:
    """What a sync is of: the records' journal, their directory, or a file (a record's)."""
    if is_directory_fd(fd):
        return "dir"
    return "journal" if os.readlink(f"/proc/self/fd/{fd}").endswith("/.journal") else "file"


class _Disk:
    """An instrumented fsync: logs what it syncs, and can hold the writer in its journal's sync
    until released (the folder's syncs are never held)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def fsync(self, fd: int) -> None:
        kind = sync_kind(fd)
        if kind == "journal":
            self.entered.set()
            self.hold.wait()
        self.log.append(kind)
        os.fsync(fd)

    async def held(self) -> None:
        """Hold the writer in its next sync of the journal, and wait until it is there."""
        self.entered.clear()
        self.hold.clear()
        await trio.to_thread.run_sync(self.entered.wait)


async def test_changes_queued_together_share_one_journal_sync(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(records.put, "first", {"id": "first"})
            await disk.held()
            for n in range(5):  # queued while the writer syncs the first
                nursery.start_soon(records.put, f"v{n}", {"id": f"v{n}"})
            await trio.testing.wait_all_tasks_blocked()
            disk.hold.set()
        assert disk.log.count("journal") == 2  # one for the first, one for the five behind it
        assert set(records.load()) == {"first", "v0", "v1", "v2", "v3", "v4"}
    finally:
        disk.hold.set()
        records.close()
    # the folder wrote them into their files: six files synced, in at most as many groups
    assert 6 <= disk.log.count("file") and 1 <= disk.log.count("dir") <= 6
    assert {p.name for p in tmp_path.glob("*.pb")} == {
        "first.pb", "v0.pb", "v1.pb", "v2.pb", "v3.pb", "v4.pb"
    }  # fmt: skip


async def test_one_records_changes_in_one_group_land_in_their_order(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(records.put, "hold", {"id": "hold"})
            await disk.held()
            changes = [
                records.put("a", {"id": "a", "sizeBytes": 1}),
                records.put("a", {"id": "a", "sizeBytes": 2}),
                records.remove("a"),
                records.put("a", {"id": "a", "sizeBytes": 3}),
                records.put("b", {"id": "b"}),
                records.remove("b"),
            ]
            for change in changes:  # each queues its change before its first checkpoint
                nursery.start_soon(lambda c=change: c)
                await trio.testing.wait_all_tasks_blocked()
            disk.hold.set()
        loaded = records.load()
        assert set(loaded) == {"hold", "a"}
        assert loaded["a"]["sizeBytes"] == 3
        assert disk.log.count("journal") <= 2
    finally:
        disk.hold.set()
        records.close()


async def test_an_acknowledged_change_was_synced_in_the_journal_then_lands_in_its_file(
    tmp_path: Path,
) -> None:
    events: list[str] = []

    def fsync(fd: int) -> None:
        os.fsync(fd)
        kind = sync_kind(fd)
        if kind == "journal":
            events.append(f"journal {[e.name for e in journal_entries(tmp_path)]}")
        else:
            events.append(f"{kind} {sorted(p.name for p in tmp_path.iterdir())}")

    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=fsync)
    events.clear()  # the journal's making
    try:
        await records.put("r", {"id": "r"})
        events.append("ack")
    finally:
        records.close()
    # in the journal, synced, before the answer; then its file synced, renamed, the directory
    # synced; then the journal emptied (a new generation) at the close
    assert events[:2] == ["journal ['r.pb']", "ack"]
    assert events[2].startswith("file ['.journal', '.r.pb.")
    assert events[3:] == ["dir ['.journal', 'r.pb']", "journal []"]


def journal_entries(directory: Path) -> list[Entry]:
    raw = (directory / ".journal").read_bytes()
    generation = _journal.current_generation(raw[: _journal.HEAD])
    assert generation is not None
    return _journal.decode_entries(raw[_journal.HEAD :], generation)


async def test_a_write_not_kept_in_time_fails_naming_the_record(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    try:
        async with trio.open_nursery() as nursery:
            # the disk is held until the late write has failed: no race on the clock
            nursery.start_soon(functools.partial(records.put, "stuck", {"id": "stuck"}, within=600))
            await disk.held()
            with pytest.raises(FeosError) as caught:
                await records.put("late", {"id": "late"}, within=0.05)
            assert caught.value.code == Code.DEADLINE_EXCEEDED
            assert "late.pb" in caught.value.message
            disk.hold.set()
        assert set(records.load()) == {"stuck"}  # the writer skips what its caller gave up
    finally:
        disk.hold.set()
        records.close()


async def test_a_cancelled_caller_still_sees_its_write_through(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    store: Store[str] = Store(records, lambda v: {"id": v}, lambda d: d["id"])
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.put, "hold", "hold")
            await disk.held()

            async def release() -> None:
                await trio.testing.wait_all_tasks_blocked()
                disk.hold.set()

            with trio.CancelScope() as scope:
                scope.cancel()  # the caller goes before its write is kept
                nursery.start_soon(release)
                await store.put("x", "x")
        assert store.get("x") == "x"
        assert "x" in records.load()
    finally:
        disk.hold.set()
        records.close()


CRASHER = """
import sys, trio
from pathlib import Path
from feos import _schema
from feos.records import RecordDir

async def main():
    records = RecordDir(Path(sys.argv[1]), _schema.volume().Volume)
    async def one(n):
        await records.put(f"v{n}", {"id": f"v{n}", "sizeBytes": n})
        print(n, flush=True)
    async def worker(first):
        for n in range(first, 10**6, 20):
            await one(n)
    async with trio.open_nursery() as nursery:
        for first in range(20):  # twenty writers at once, so that groups form
            nursery.start_soon(worker, first)
trio.run(main)
"""


def test_a_record_acknowledged_is_on_disk_when_the_process_is_killed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        acknowledged = [int(proc.stdout.readline()) for _ in range(200)]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        loaded = records.load()
    finally:
        records.close()
    for n in acknowledged:
        assert loaded[f"v{n}"]["sizeBytes"] == n


# -- changes queued from an asyncio loop (the Cap'n Proto thread's creates) ----------------------


def _on_asyncio(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """main() run on an asyncio loop of a thread of its own, as the Cap'n Proto thread runs."""
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(main())), name="asyncio")
    thread.start()
    thread.join(60)
    assert box, "the asyncio side failed (see the thread's traceback)"
    return box[0]


def test_a_change_from_asyncio_is_acknowledged_there_once_synced(tmp_path: Path) -> None:
    events: list[str] = []

    def fsync(fd: int) -> None:
        os.fsync(fd)
        if sync_kind(fd) == "journal":
            events.append(f"journal {threading.current_thread().name}")

    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=fsync)
    events.clear()  # the journal's making

    async def main() -> None:
        def kept(_reader: object) -> None:
            events.append(f"kept {threading.current_thread().name}")

        await records.submit_put("r", {"id": "r"}, kept).wait(10)
        events.append(f"ack {threading.current_thread().name}")

    try:
        _on_asyncio(main)
    finally:
        records.close()
    writer = "records-" + tmp_path.name
    # synced in the journal by the writer; its memory changed and its caller answered on the
    # asyncio thread, in that order: no other loop in between (then the journal emptied by the
    # close)
    assert events == [f"journal {writer}", "kept asyncio", "ack asyncio", "journal MainThread"]
    assert set(records.load()) == {"r"}


def test_changes_from_asyncio_share_a_directory_sync_and_keep_their_order(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    seen: list[int] = []

    async def main() -> None:
        disk.entered.clear()
        disk.hold.clear()
        first = records.submit_put("first", {"id": "first"}, lambda _r: None)
        await asyncio.to_thread(disk.entered.wait)  # the writer is held in the first's sync
        changes = [
            records.submit_put("a", {"id": "a", "sizeBytes": n}, lambda _r, n=n: seen.append(n))
            for n in range(1, 6)
        ]
        disk.hold.set()
        await asyncio.gather(first.wait(10), *(c.wait(10) for c in changes))

    try:
        _on_asyncio(main)
    finally:
        disk.hold.set()
        records.close()
    assert seen == [1, 2, 3, 4, 5]  # the memory follows the disk, in the order asked for
    # one for the first, one for the five behind it, one to empty it at the close
    assert disk.log.count("journal") == 3
    assert records.load()["a"]["sizeBytes"] == 5


def test_a_change_from_asyncio_not_kept_in_time_fails_and_its_cancelled_caller_sees_it_through(
    tmp_path: Path,
) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    store: Store[str] = Store(records, lambda v: {"id": v}, lambda d: d["id"])

    async def main() -> tuple[FeosError, bool]:
        disk.entered.clear()
        disk.hold.clear()
        stuck = store.stage("stuck", "stuck")
        await asyncio.to_thread(disk.entered.wait)
        late = records.submit_put("late", {"id": "late"}, lambda _r: None)
        try:
            await late.wait(0.05)
        except FeosError as exc:
            error = exc
        waiter = asyncio.ensure_future(store.kept(stuck))
        await asyncio.sleep(0)
        waiter.cancel()  # its caller goes: the change goes on
        disk.hold.set()
        await stuck.change.wait(10)  # a second waiter of the same change hears it
        return error, waiter.cancelled()

    try:
        error, cancelled = _on_asyncio(main)
    finally:
        disk.hold.set()
        records.close()
    assert error.code is Code.DEADLINE_EXCEEDED and "late.pb" in error.message
    assert cancelled
    assert store.get("stuck") == "stuck"
    assert set(records.load()) == {"stuck"}  # the writer skipped what its caller gave up


TRACED = """
import sys, trio
from pathlib import Path
from feos import _schema
from feos.records import RecordDir

async def main():
    records = RecordDir(Path(sys.argv[1]), _schema.volume().Volume)
    async def one(n):
        await records.put(f"v{n}", {"id": f"v{n}"})
        print(f"acked v{n}", flush=True)
    async with trio.open_nursery() as nursery:
        for n in range(8):  # at once, so that groups form
            nursery.start_soon(one, n)
    records.close()
trio.run(main)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
@pytest.mark.skipif(not native.available(), reason="feos._native is not built")
def test_each_change_is_in_the_synced_journal_before_its_answer_then_folded_natively(
    tmp_path: Path,
) -> None:
    """The default writer's steps, as the kernel sees them: each change written into the journal
    and the journal synced (fdatasync) before its caller is told; later, by the folder, each
    record's temporary file synced, renamed over the record, and the directory synced."""
    trace = tmp_path / "trace"
    records = tmp_path / "records"
    subprocess.run(
        ["strace", "-f", "-y", "-s", "4096", "-o", str(trace), "-e",
         "trace=fsync,fdatasync,pwrite64,rename,renameat,renameat2,write",
         sys.executable, "-c", TRACED, str(records)],
        check=True, stdout=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    lines = trace.read_text().splitlines()

    def first(pattern: str, after: int = -1) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line) and i > after]
        assert found, f"no {pattern!r} in the trace after line {after}"
        return found[0]

    journal = rf"\d+<{records}/\.journal>"
    for n in range(8):
        acked = first(rf'write\(1<[^>]*>, "acked v{n}"')
        written = first(rf'pwrite64\({journal}, ".*v{n}\.pb')
        journal_synced = first(rf"fdatasync\({journal}\)", written)
        assert written < journal_synced < acked, f"v{n}: {lines[written : acked + 1]}"
        synced = first(rf"fsync\(\d+<{records}/\.v{n}\.pb\.\d+\.tmp>\)")
        # renameat in the directory: the native call's (Python's own would rename by path)
        renamed = first(
            rf'renameat\(\d+<{records}>, "\.v{n}\.pb\.\d+\.tmp", \d+<{records}>, "v{n}\.pb"'
        )
        dir_synced = first(rf"fsync\(\d+<{records}>\)", renamed)
        assert synced < renamed < dir_synced, f"v{n}: {lines[synced : dir_synced + 1]}"


def test_close_waits_for_a_change_whose_caller_went(tmp_path: Path) -> None:
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)

    async def main() -> None:
        disk.entered.clear()
        disk.hold.clear()
        records.submit_put("a", {"id": "a"}, lambda _r: None)  # nobody waits: the loop ends
        await asyncio.to_thread(disk.entered.wait)

    try:
        _on_asyncio(main)
        release = threading.Timer(0.2, disk.hold.set)  # the disk answers after close is called
        release.start()
        records.close()
        release.join()
    finally:
        disk.hold.set()
    assert (tmp_path / "a.pb").exists()
    assert records.load().keys() == {"a"}


def test_close_twice_is_one_close(tmp_path: Path) -> None:
    records = RecordDir(tmp_path, _schema.volume().Volume)
    records.close()
    records.close()
    assert records.load() == {}


# -- the folder folds in the writer's pauses -----------------------------------------------------


def record_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.pb")}


async def test_the_folder_waits_for_the_writers_pause_then_folds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While changes keep coming, within FOLD_IDLE of each other, no record file is written (the
    journal's syncs do not queue behind the files'); once they pause, the folder writes them all
    in one group, without a close."""
    monkeypatch.setattr(records_module, "FOLD_IDLE", 1.5)
    monkeypatch.setattr(records_module, "FOLD_AFTER_MAX", 60.0)
    disk = _Disk()
    records = RecordDir(tmp_path, _schema.volume().Volume, fsync=disk.fsync)
    disk.log.clear()  # the journal's making
    try:
        for n in range(20):
            await records.put(f"v{n}", {"id": f"v{n}"})
        await trio.sleep(0.3)
        assert record_files(tmp_path) == set()
        assert "file" not in disk.log and "dir" not in disk.log
        assert disk.log.count("journal") >= 20  # each acknowledged once in the synced journal
        for _ in range(600):  # the pause's fold, within 30 s
            if len(record_files(tmp_path)) == 20:
                break
            await trio.sleep(0.05)
        assert len(record_files(tmp_path)) == 20
        assert disk.log.count("dir") == 1  # the twenty in one group
        assert set(records.load()) == {f"v{n}" for n in range(20)}
    finally:
        records.close()


async def test_a_steady_stream_is_folded_after_fold_after_max(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes that never pause are folded all the same, FOLD_AFTER_MAX after the oldest."""
    monkeypatch.setattr(records_module, "FOLD_IDLE", 60.0)
    monkeypatch.setattr(records_module, "FOLD_AFTER_MAX", 0.2)
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        with trio.fail_after(30):
            n = 0
            while not record_files(tmp_path):  # a change every 10 ms: never a pause of 60 s
                await records.put(f"v{n}", {"id": f"v{n}"})
                n += 1
                await trio.sleep(0.01)
        assert n >= 2
    finally:
        records.close()
    assert record_files(tmp_path) == {f"v{i}.pb" for i in range(n)}  # the close folds the rest


async def test_a_full_journal_and_the_close_do_not_wait_for_a_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer that needs the journal's room hurries the folder, and a close folds at once:
    neither waits for FOLD_IDLE or FOLD_AFTER_MAX."""
    monkeypatch.setattr(records_module, "FOLD_IDLE", 600.0)
    monkeypatch.setattr(records_module, "FOLD_AFTER_MAX", 600.0)
    records = RecordDir(tmp_path, _schema.volume().Volume, journal_bytes=2048)
    try:
        with trio.fail_after(60):
            for n in range(200):  # the journal is full many times over
                await records.put(f"v{n}", {"id": f"v{n}"})
        assert record_files(tmp_path)  # folded when the journal had no room
    finally:
        with trio.fail_after(60):
            await trio.to_thread.run_sync(records.close)
    assert record_files(tmp_path) == {f"v{n}.pb" for n in range(200)}
