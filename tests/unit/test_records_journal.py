"""The records' journal: its bytes read back, what a crash leaves of it, and what opening replays.

The kill test runs a writer of acknowledged puts and removals in a child process killed -9 at
points spread over its stream (its journal small, so that kills also land in folds and in new
generations); the others build journals as a crash would leave them: a torn tail, a fold cut
midway, an older generation's entries after the end, a header torn.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos import _journal, _schema
from feos._journal import HEAD, SLOT, Entry, Journal
from feos.errors import Code, FeosError
from feos.records import RecordDir

VOLUME = _schema.volume().Volume

entries = st.lists(
    st.builds(
        Entry,
        st.text(st.characters(blacklist_characters="/\0", codec="utf-8"), min_size=1, max_size=12)
        .filter(lambda n: n not in (".", "..")),
        st.none() | st.binary(max_size=64),
    ),
    max_size=12,
)  # fmt: skip


def area(generation: int, items: list[Entry]) -> bytes:
    return b"".join(_journal.encode_entry(generation, i, e) for i, e in enumerate(items, 1))


@settings(max_examples=200, deadline=None)
@given(items=entries, generation=st.integers(1, 2**64 - 1))
def test_entries_read_back_as_written(items: list[Entry], generation: int) -> None:
    raw = area(generation, items) + bytes(100)
    assert _journal.decode_entries(raw, generation) == items
    assert _journal.decode_entries(raw, generation + 1 if generation < 2**64 - 1 else 1) == []


@settings(max_examples=300, deadline=None)
@given(items=entries, data=st.data())
def test_a_damaged_journal_reads_as_the_entries_before_the_damage(
    items: list[Entry], data: st.DataObject
) -> None:
    """A torn tail (cut short, or any byte changed): the entries wholly before it, and nothing
    after it."""
    raw = area(7, items)
    ends = [len(area(7, items[: i + 1])) for i in range(len(items))]
    at = data.draw(st.integers(0, max(0, len(raw) - 1)))
    if data.draw(st.booleans()) or not raw:
        damaged = raw[:at] + bytes(64)
    else:
        damaged = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    whole = sum(1 for end in ends if end <= at)
    assert _journal.decode_entries(damaged, 7) == items[:whole]


def test_an_older_generation_after_the_end_is_not_read() -> None:
    """A new generation written over an old one, its entries as long as the old ones: the old
    entries after the new ones are never taken for the next."""
    old = [Entry(f"r{n}.pb", b"x" * 10) for n in range(5)]
    new = [Entry(f"r{n}.pb", b"y" * 10) for n in range(2)]
    raw = area(2, new) + area(1, old)[len(area(2, new)) :]
    assert len(area(2, new)) == len(area(1, old[:2]))
    assert _journal.decode_entries(raw, 2) == new


def test_the_higher_valid_header_is_the_journals() -> None:
    head = bytearray(HEAD)
    head[SLOT : SLOT + 20] = _journal.encode_header(3)
    head[0:20] = _journal.encode_header(4)
    assert _journal.current_generation(bytes(head)) == 4
    head[5] ^= 0xFF  # the newer header's write was torn: the older one stands
    assert _journal.current_generation(bytes(head)) == 3
    assert _journal.current_generation(bytes(HEAD)) is None


# -- what opening a directory replays ------------------------------------------------------------


def volume(record_id: str, size: int) -> bytes:
    return bytes(VOLUME.new_message(id=record_id, sizeBytes=size).to_bytes_packed())


def journal_with(directory: Path, items: list[Entry]) -> Journal:
    """A journal holding `items`, as a run that was killed before its folder wrote them."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        journal = Journal.make(directory, dir_fd, 1 << 16, os.fdatasync, os.fsync)
    finally:
        os.close(dir_fd)
    journal.append(items)
    return journal


def opened(directory: Path) -> dict[str, int]:
    records = RecordDir(directory, VOLUME)
    try:
        return {k: v.get("sizeBytes", 0) for k, v in records.load().items()}
    finally:
        records.close()


def entries_now(directory: Path) -> list[Entry]:
    raw = (directory / ".journal").read_bytes()
    generation = _journal.current_generation(raw[:HEAD])
    assert generation is not None
    return _journal.decode_entries(raw[HEAD:], generation)


def test_a_torn_tail_ends_the_journal(tmp_path: Path) -> None:
    journal = journal_with(tmp_path, [Entry("a.pb", volume("a", 1)), Entry("b.pb", volume("b", 2))])
    journal.close()
    raw = bytearray((tmp_path / ".journal").read_bytes())
    end = HEAD + len(area(1, [Entry("a.pb", volume("a", 1)), Entry("b.pb", volume("b", 2))]))
    raw[end - 3] ^= 0x55  # b's last bytes never reached the disk: b was never acknowledged
    (tmp_path / ".journal").write_bytes(bytes(raw))
    assert opened(tmp_path) == {"a": 1}
    assert (tmp_path / "a.pb").read_bytes() == volume("a", 1)  # written into its file
    assert entries_now(tmp_path) == []  # and the journal started again


def test_a_fold_cut_midway_is_finished_at_the_next_open(tmp_path: Path) -> None:
    (tmp_path / "c.pb").write_bytes(volume("c", 9))  # removed in the journal, still here
    changes = [
        Entry("a.pb", volume("a", 1)),
        Entry("b.pb", volume("b", 2)),
        Entry("a.pb", volume("a", 3)),
        Entry("c.pb", None),
        Entry("d.pb", volume("d", 4)),
    ]
    journal_with(tmp_path, changes).close()
    # the folder had written a's first change and b, and had begun d's file
    (tmp_path / "a.pb").write_bytes(volume("a", 1))
    (tmp_path / "b.pb").write_bytes(volume("b", 2))
    (tmp_path / ".d.pb.7.tmp").write_bytes(volume("d", 4)[:3])
    assert opened(tmp_path) == {"a": 3, "b": 2, "d": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".journal", "a.pb", "b.pb", "d.pb"]
    assert opened(tmp_path) == {"a": 3, "b": 2, "d": 4}  # and again: nothing written twice wrong


def test_changes_the_files_cannot_take_keep_the_journal_and_fail_the_open(tmp_path: Path) -> None:
    journal_with(tmp_path, [Entry("a.pb", volume("a", 1)), Entry("b.pb", volume("b", 2))]).close()
    (tmp_path / "b.pb").mkdir()  # b's file cannot be renamed into place
    (tmp_path / "b.pb" / "x").write_bytes(b"")
    with pytest.raises(FeosError) as caught:
        RecordDir(tmp_path, VOLUME)
    assert caught.value.code is Code.UNAVAILABLE
    assert "2 changes of the journal could not be written" in caught.value.message
    assert len(entries_now(tmp_path)) == 2  # nothing acknowledged is lost
    (tmp_path / "b.pb" / "x").unlink()
    (tmp_path / "b.pb").rmdir()
    assert opened(tmp_path) == {"a": 1, "b": 2}


def test_a_journal_without_a_header_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.pb").write_bytes(volume("a", 1))
    (tmp_path / ".journal").write_bytes(bytes(HEAD + 100))
    with caplog.at_level(logging.ERROR, logger="feos.records"):
        assert opened(tmp_path) == {"a": 1}
    assert "holds no valid header: moved aside" in caplog.text
    assert list(tmp_path.glob(".journal.broken-*"))
    assert entries_now(tmp_path) == []  # a new one made


async def test_a_small_journal_starts_new_generations_and_grows_for_a_big_record(
    tmp_path: Path,
) -> None:
    records = RecordDir(tmp_path, VOLUME, journal_bytes=4096)
    try:
        for n in range(300):  # about 25 bytes each: the journal is full about every 100
            await records.put(f"v{n % 7}", {"id": f"v{n % 7}", "sizeBytes": n})
        big = "x" * 20_000  # bigger than the whole journal
        await records.put("big", {"id": "big", "podId": big})
        loaded = records.load()
    finally:
        records.close()
    assert {k: v["sizeBytes"] for k, v in loaded.items() if k != "big"} == {
        f"v{m}": max(n for n in range(300) if n % 7 == m) for m in range(7)
    }
    assert loaded["big"]["podId"] == big
    assert (tmp_path / ".journal").stat().st_size > HEAD + 20_000
    assert opened(tmp_path)["v6"] == 293


# -- killed -9 at any point ----------------------------------------------------------------------

STREAM = """
import os, sys, trio
from pathlib import Path
from feos import _schema
from feos.records import RecordDir

def state(n):
    return None if n % 3 == 2 else n  # every third change of a record is its removal

async def main():
    records = RecordDir(Path(sys.argv[1]), _schema.volume().Volume, journal_bytes=2048)
    async def writer(r):
        for n in range(10**6):
            if state(n) is None:
                await records.remove(f"r{r}")
            else:
                await records.put(f"r{r}", {"id": f"r{r}", "sizeBytes": n})
            os.write(1, f"{r} {n}\\n".encode())  # one write: a kill leaves no half line
    async with trio.open_nursery() as nursery:
        for r in range(12):  # at once, so that groups form
            nursery.start_soon(writer, r)
trio.run(main)
"""


def state(n: int) -> int | None:
    return None if n % 3 == 2 else n


@pytest.mark.parametrize("kill_after", [1, 5, 23, 64, 150, 333, 700, 1200])
def test_every_acknowledged_change_survives_a_kill_at_any_point(
    tmp_path: Path, kill_after: int
) -> None:
    """Each of twelve records is changed by a task of its own, one change after the other: after
    the kill each holds its last acknowledged change, or the one after it (begun, unanswered)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STREAM, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    answered = []
    try:
        answered = [proc.stdout.readline() for _ in range(kill_after)]
        time.sleep((kill_after % 7) / 1000)  # a few more in flight, or folding
    finally:
        proc.kill()
        proc.wait()
    with proc.stdout:
        answered += proc.stdout.readlines()  # what it answered before the kill, all
    last: dict[int, int] = {}
    for line in answered:
        r, n = map(int, line.split())
        last[r] = n
    loaded = opened(tmp_path)
    for r in range(12):
        n = last.get(r, -1)
        may = {state(n) if n >= 0 else None, state(n + 1)}
        assert loaded.get(f"r{r}") in may, f"r{r}: acknowledged {n}, found {loaded.get(f'r{r}')}"
    assert entries_now(tmp_path) == []
