"""Punching zero pages: the scan on buffers, the syscall on a real file."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from feos.vmm._firecracker_punch import PAGE, merge, punch_zero_pages, zero_runs


def test_runs_of_zero_pages() -> None:
    buf = bytes(PAGE) * 2 + b"x" * PAGE + bytes(PAGE) + b"tail"
    assert list(zero_runs(buf, base=8 * PAGE)) == [(8 * PAGE, 2 * PAGE), (11 * PAGE, PAGE)]


def test_merge_joins_touching_runs() -> None:
    assert list(merge(iter([(0, 4), (4, 4), (12, 4)]))) == [(0, 8), (12, 4)]


@given(st.lists(st.booleans(), max_size=40))
def test_runs_cover_exactly_the_zero_pages(pages: list[bool]) -> None:
    buf = b"".join(bytes(PAGE) if z else b"\x01" * PAGE for z in pages)
    covered = set()
    for off, length in zero_runs(buf):
        assert off % PAGE == 0
        assert length % PAGE == 0
        covered.update(range(off // PAGE, (off + length) // PAGE))
    assert covered == {i for i, z in enumerate(pages) if z}


def test_punch_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "memory"
    data_pages = {3, 4, 100, 2047}
    with open(path, "wb") as f:
        for i in range(2048):  # 8 MiB, written whole like a snapshot's memory
            f.write(os.urandom(PAGE) if i in data_pages else bytes(PAGE))
        f.flush()
        os.fsync(f.fileno())
    before = path.read_bytes()
    allocated = os.stat(path).st_blocks * 512
    assert allocated >= len(before)
    punched = punch_zero_pages(path)
    assert punched == (2048 - len(data_pages)) * PAGE
    st_after = os.stat(path)
    assert st_after.st_size == len(before)
    assert st_after.st_blocks * 512 <= (len(data_pages) + 16) * PAGE
    assert path.read_bytes() == before
    assert punch_zero_pages(path) == 0  # the holes are not read again
