"""Punching the zero pages out of a snapshot's memory file.

A snapshot's memory file is as large as the guest's memory; what the balloon's free page
reporting gave back, and what the guest never touched, is written as zeroes. Punching holes over
those pages (fallocate PUNCH_HOLE, the size kept) gives the blocks back to the disk, and a
restore reads the holes as zeroes again. The scan is pure (which 4 KiB pages of a buffer are
zero, as runs); the syscall is one ctypes call. Only the file's data regions are read
(SEEK_DATA/SEEK_HOLE), so a file punched before is not read again.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

PAGE = 4096
CHUNK = 1 << 20
_ZERO_CHUNK = bytes(CHUNK)
_ZERO_PAGE = bytes(PAGE)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def zero_runs(buf: bytes | memoryview, base: int = 0) -> Iterator[tuple[int, int]]:
    """(offset, length) of the runs of whole zero pages in `buf`, which starts at file offset
    `base` (page-aligned); a partial page at the end is never a run."""
    view = memoryview(buf)
    start = None
    whole = len(view) - len(view) % PAGE
    for off in range(0, whole, PAGE):
        if view[off : off + PAGE] == _ZERO_PAGE:
            if start is None:
                start = off
        elif start is not None:
            yield base + start, off - start
            start = None
    if start is not None:
        yield base + start, whole - start


def merge(runs: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Join runs that touch, so that a long zero stretch across chunks is one punch."""
    cur: tuple[int, int] | None = None
    for off, length in runs:
        if cur is not None and cur[0] + cur[1] == off:
            cur = (cur[0], cur[1] + length)
            continue
        if cur is not None:
            yield cur
        cur = (off, length)
    if cur is not None:
        yield cur


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


def _data_regions(fd: int, size: int) -> Iterator[tuple[int, int]]:
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            return  # ENXIO: nothing but a hole after pos
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start - start % PAGE, end
        pos = end


def _scan(fd: int, size: int) -> Iterator[tuple[int, int]]:
    for start, end in _data_regions(fd, size):
        for off in range(start, end, CHUNK):
            chunk = os.pread(fd, min(CHUNK, end - off), off)
            if chunk == _ZERO_CHUNK:
                yield off, CHUNK
            else:
                yield from zero_runs(chunk, off)


def punch_zero_pages(path: Path) -> int:
    """Punch out every zero page of the file; returns the bytes punched. Blocking: run it on a
    worker thread."""
    punched = 0
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        for off, length in merge(_scan(fd, size)):
            punch_hole(fd, off, length)
            punched += length
    finally:
        os.close(fd)
    return punched
