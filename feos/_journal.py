"""A records directory's journal: its changes, kept by one small synced write before their files.

Theory of operation: `.journal` in the directory is a file written whole when it is made (zeros,
synced, renamed into place), so that a later write inside it overwrites blocks the filesystem
already has: its fdatasync then sends the data and a cache flush, with no metadata to commit, a
fraction of a new file's write, fsync, rename and directory fsync. It holds two header slots and
then the entries of one generation, one after the other from the start of the entries' area.

A header slot holds the generation (slot `generation % 2`) and a CRC; the valid slot with the
higher generation is the journal's. An entry holds a CRC of the rest of it, its generation, its
sequence number (1, 2, ... within the generation), the record's file name and the record's bytes
(none for a removal). Reading stops at the first entry that is not the next one (a bad CRC, an
other generation, a gap): that is a tail torn by a crash, never acknowledged, or what an older
generation left after the end.

A new generation starts (`reset`) only once every entry of the current one is in its record
file, synced with its directory: its header is written and synced first, and only then are its
entries written over the old ones. So whatever a crash leaves, the entries read are a whole
generation's from its start up to some point, and the record files hold at least every change
before that generation: replaying the entries in order over the files gives each record its
last change. A crash cut in the middle of a header's write leaves the other slot, whose
generation's entries are still whole.

The pure part (the bytes of headers and entries, and reading them back) does no I/O.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

log = logging.getLogger(__name__)

NAME = ".journal"
MAGIC = b"FEOSJRN1"
SLOT = 4096  # a header slot: a block of its own, so that a torn write of one spares the other
HEAD = 2 * SLOT
CAPACITY = 1 << 20
"""Bytes of entries a journal is made with (about 4,000 records of a volume's size)."""
RESET_AFTER = 64 << 10
"""Bytes of entries after which a new generation starts, as soon as the files hold them all."""

_HEADER = struct.Struct("<8sQI")  # magic, generation, CRC of the two
_ENTRY = struct.Struct("<IIQQHB")  # CRC of the rest, data length, generation, seq, name len, kind
_PUT, _REMOVE = 0, 1

Sync = Callable[[int], None]


@attrs.frozen
class Entry:
    """One change of a record: its file name, and its bytes (None: removed)."""

    name: str
    data: bytes | None


def entry_size(name: str, data: bytes | None) -> int:
    return _ENTRY.size + len(os.fsencode(name)) + len(data or b"")


def encode_header(generation: int) -> bytes:
    body = MAGIC + generation.to_bytes(8, "little")
    return _HEADER.pack(MAGIC, generation, zlib.crc32(body))


def decode_header(raw: bytes) -> int | None:
    """The generation in a header slot, or None if the slot holds none (or a torn one)."""
    if len(raw) < _HEADER.size:
        return None
    magic, generation, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC or crc != zlib.crc32(MAGIC + generation.to_bytes(8, "little")):
        return None
    return int(generation)


def current_generation(head: bytes) -> int | None:
    """The generation of the journal whose first HEAD bytes are `head` (the higher valid slot)."""
    found = [g for g in (decode_header(head[:SLOT]), decode_header(head[SLOT:HEAD])) if g]
    return max(found) if found else None


def encode_entry(generation: int, seq: int, entry: Entry) -> bytes:
    name = os.fsencode(entry.name)
    data = entry.data or b""
    kind = _REMOVE if entry.data is None else _PUT
    rest = _ENTRY.pack(0, len(data), generation, seq, len(name), kind)[4:] + name + data
    return zlib.crc32(rest).to_bytes(4, "little") + rest


def decode_entries(area: bytes, generation: int) -> list[Entry]:
    """The entries of `generation` from the start of the entries' area, up to the first that is
    not the next one."""
    entries: list[Entry] = []
    offset = 0
    while offset + _ENTRY.size <= len(area):
        crc, length, gen, seq, name_length, kind = _ENTRY.unpack_from(area, offset)
        end = offset + _ENTRY.size + name_length + length
        if gen != generation or seq != len(entries) + 1 or kind not in (_PUT, _REMOVE):
            break
        if end > len(area) or crc != zlib.crc32(area[offset + 4 : end]):
            break
        name = os.fsdecode(area[offset + _ENTRY.size : offset + _ENTRY.size + name_length])
        if not _plain_name(name) or (kind == _REMOVE and length):
            break
        data = area[end - length : end] if kind == _PUT else None
        entries.append(Entry(name, data))
        offset = end
    return entries


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


class Journal:
    """The journal of one directory, used by its writer thread alone (`recover` before it)."""

    def __init__(self, path: Path, fd: int, generation: int, sync: Sync) -> None:
        self.path = path
        self._fd = fd
        self._sync = sync  # os.fdatasync, or a test's instrumented sync
        self.generation = generation
        self.size = os.fstat(fd).st_size
        self._tail = HEAD
        self._seq = 0
        self.broken = False  # a write or sync failed: what the file holds past the tail is unknown

    @classmethod
    def make(cls, directory: Path, dir_fd: int, capacity: int, sync: Sync, fsync: Sync) -> Journal:
        """A new journal (generation 1), whole and in place once this returns."""
        tmp = directory / f"{NAME}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_zeros(fd, 0, HEAD + capacity)
            os.pwrite(fd, encode_header(1), SLOT)
            fsync(fd)
            os.rename(tmp, directory / NAME)
            fsync(dir_fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(directory / NAME, fd, 1, sync)

    @classmethod
    def recover(cls, directory: Path, sync: Sync) -> tuple[Journal, list[Entry]] | None:
        """The directory's journal and the entries it holds; None if there is none. Raises
        ValueError if the file holds no valid header (the caller sets it aside)."""
        path = directory / NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            raw = _read_all(fd)
            generation = current_generation(raw[:HEAD])
            if generation is None:
                raise ValueError(f"{path} holds no valid header")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, generation, sync), decode_entries(raw[HEAD:], generation)

    @classmethod
    def recover_or_set_aside(cls, directory: Path, sync: Sync,
                             what: str) -> tuple[Journal, list[Entry]] | None:
        """`recover` after a stale temporary journal (a make a crash cut) is removed; a journal
        with no valid header is moved aside as `.journal.broken-<time>`, logged as `what`'s,
        and None answered (the caller makes a new one)."""
        (directory / f"{NAME}.tmp").unlink(missing_ok=True)
        try:
            return cls.recover(directory, sync)
        except ValueError as exc:
            aside = directory / f"{NAME}.broken-{int(time.time())}"
            log.error("%s: %s: moved aside to %s", what, exc, aside.name)
            os.rename(directory / NAME, aside)
            return None

    @property
    def used(self) -> int:
        return self._tail - HEAD

    def fits(self, size: int) -> bool:
        return not self.broken and self._tail + size <= self.size

    def append(self, entries: Sequence[Entry]) -> None:
        """The entries written after the last ones and synced; OSError if not (then `broken`)."""
        blob = b"".join(
            encode_entry(self.generation, self._seq + i, e) for i, e in enumerate(entries, 1)
        )
        self.broken = True
        _write_all(self._fd, blob, self._tail)
        self._sync(self._fd)
        self.broken = False
        self._tail += len(blob)
        self._seq += len(entries)

    def reset(self, room: int) -> None:
        """A new generation, with at least `room` bytes for entries. Only once every entry of
        the current one is in its record file, synced."""
        self.broken = True  # until the new header is synced: a failed one is written again
        if HEAD + room > self.size:
            size = max(HEAD + room, HEAD + 2 * (self.size - HEAD))
            _write_zeros(self._fd, self.size, size - self.size)
            os.fsync(self._fd)  # the size is metadata: a full sync
            self.size = size
        generation = self.generation + 1
        os.pwrite(self._fd, encode_header(generation), (generation % 2) * SLOT)
        self._sync(self._fd)
        self.generation, self._tail, self._seq, self.broken = generation, HEAD, 0, False

    def close(self) -> None:
        os.close(self._fd)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        wrote = os.pwrite(fd, view, offset)
        view, offset = view[wrote:], offset + wrote


def _write_zeros(fd: int, offset: int, length: int) -> None:
    chunk = bytes(min(length, 1 << 20))
    end = offset + length
    while offset < end:
        _write_all(fd, chunk[: end - offset], offset)
        offset += min(len(chunk), end - offset)


def _read_all(fd: int) -> bytes:
    parts = []
    offset = 0
    while part := os.pread(fd, 1 << 20, offset):
        parts.append(part)
        offset += len(part)
    return b"".join(parts)
