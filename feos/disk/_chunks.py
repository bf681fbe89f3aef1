"""A layer file as a sequence of fixed-size chunks, and the node's cache of fetched chunks.

A layer is cut at every CHUNK_SIZE bytes; a chunk of zeroes only is a hole (`None`): it is
neither stored nor cached, and a layer assembled from its chunks leaves it unallocated, so a
sparse layer moves and costs little. Every other chunk is named by the sha256 of its bytes.

The cache keeps fetched chunks whole under its directory, one file each, named by that hex
(written to a temporary file, fsynced, renamed: a crash leaves a chunk whole or absent). A chunk
is verified against its name when it goes in (`put`); `get` only checks that the file still has
the size it went in with, and `read` verifies the bytes again and throws away a chunk that does
not match, so a chunk damaged on disk is fetched again and never served. Over its limit the
cache forgets the least recently used chunks that no owner pins (a layer being assembled, a disk
that reads through it). One lock guards the index; the file I/O of a put runs outside it.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import itertools
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

from ..errors import Code, FeosError

log = logging.getLogger(__name__)

CHUNK_SIZE = 4 * 1024 * 1024
"""Bytes of a layer in one chunk (the last one may be shorter)."""

_ZERO = bytes(CHUNK_SIZE)
_HEX = re.compile(r"[0-9a-f]{64}\Z")
_TMP_SUFFIX = ".tmp"


def is_chunk_hex(name: str) -> bool:
    return _HEX.match(name) is not None


def chunk_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def zeroes(length: int) -> memoryview:
    """`length` zero bytes without a copy (length <= CHUNK_SIZE): what a hole hashes as."""
    return memoryview(_ZERO)[:length]


def is_zero(data: bytes) -> bool:
    if len(data) == CHUNK_SIZE:
        return data == _ZERO  # one memcmp
    return data.count(0) == len(data)


@attrs.frozen
class Chunk:
    """One chunk of a layer file: its place, and its bytes (None for a hole)."""

    offset: int
    length: int
    data: bytes | None


def read_chunks(fd: int, size: int, chunk_size: int = CHUNK_SIZE) -> Iterator[Chunk]:
    """The chunks of the first `size` bytes of the open file `fd`, in order.

    A chunk inside a hole of the file (SEEK_DATA finds no data in it) is a hole without being
    read; a chunk read as zeroes only is one too.
    """
    for offset in range(0, size, chunk_size):
        length = min(chunk_size, size - offset)
        if not _has_data(fd, offset, length):
            yield Chunk(offset, length, None)
            continue
        data = pread_exactly(fd, length, offset)
        yield Chunk(offset, length, None if is_zero(data) else data)


def _has_data(fd: int, offset: int, length: int) -> bool:
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) < offset + length
    except OSError as exc:  # ENXIO: no data from offset to the end
        return exc.errno != errno.ENXIO


def pread_exactly(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length:
        part = os.pread(fd, length, offset)
        if not part:
            raise FeosError(Code.DATA_LOSS, f"file ends at {offset} while {length} more bytes "
                            "were expected (it shrank while being read)")  # fmt: skip
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


@attrs.frozen
class CacheStats:
    """The cache as DiskdInfo.cache shows it."""

    limit_bytes: int
    used_bytes: int
    chunks: int
    evicted_chunks: int  # since the cache was opened: evictions and collections
    corrupt_chunks: int  # since then: chunks that failed their check on read and were dropped


class ChunkCache:
    """Fetched chunks under `directory`, at most `limit_bytes` of them but for pinned ones.

    A put over the limit evicts what it can; pinned chunks are never evicted, so the cache can
    stand above its limit by what is pinned until it is unpinned (then it evicts again).
    """

    def __init__(self, directory: Path, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise FeosError(Code.INVALID_ARGUMENT, f"cache size: {limit_bytes} is negative")
        self.directory = directory
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU first
        self._used = 0
        self._pins: dict[str, frozenset[str]] = {}
        self._pinned: collections.Counter[str] = collections.Counter()
        self._evicted = 0
        self._corrupt = 0
        self._tmp_names = itertools.count()
        directory.mkdir(parents=True, exist_ok=True)
        self._recount()

    def _recount(self) -> None:
        """The chunks a previous run left, least recently used first (by mtime, which a hit
        refreshes); temporary files of writes a crash cut off are removed."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(_TMP_SUFFIX):
                unlink_quietly(Path(entry.path))
            elif is_chunk_hex(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, hex_, size in sorted(found):
            self._index[hex_] = size
            self._used += size
        self.evict()

    def path(self, hex_: str) -> Path:
        return self.directory / hex_

    def __contains__(self, hex_: object) -> bool:
        with self._lock:
            return hex_ in self._index

    def get(self, hex_: str) -> Path | None:
        """The chunk's file if the cache has it whole (its size as it went in), else None.

        Cheap: its bytes are not checked (use `read` to serve them).
        """
        with self._lock:
            size = self._index.get(hex_)
            if size is None:
                return None
            path = self.path(hex_)
            try:
                ok = os.stat(path).st_size == size
            except FileNotFoundError:
                ok = False
            if not ok:
                self._drop(hex_)
                return None
            self._index.move_to_end(hex_)
        _touch(path)
        return path

    def read(self, hex_: str) -> bytes | None:
        """The chunk's bytes, verified against its name; a chunk that fails is dropped."""
        path = self.get(hex_)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted or collected since get
            return None
        if chunk_hex(data) == hex_:
            return data
        log.warning("cached chunk %s does not match its digest: dropped, to be fetched again", hex_)
        with self._lock:
            if hex_ in self._index:
                self._drop(hex_)
                self._corrupt += 1
        return None

    def put(self, hex_: str, data: bytes) -> Path:
        """Keep a chunk (verified first: DATA_LOSS when its bytes are not `hex_`)."""
        if not is_chunk_hex(hex_):
            raise FeosError(Code.INVALID_ARGUMENT, f"chunk {hex_!r}: not 64 lowercase hex digits")
        if chunk_hex(data) != hex_:
            raise FeosError(Code.DATA_LOSS, f"chunk {hex_}: its bytes have another sha256")
        path = self.path(hex_)
        with self._lock:
            tmp = self.directory / f".{hex_}.{os.getpid()}.{next(self._tmp_names)}{_TMP_SUFFIX}"
        try:
            _write_synced(tmp, data)
            os.rename(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        with self._lock:
            if hex_ not in self._index:
                self._used += len(data)
            self._index[hex_] = len(data)
            self._index.move_to_end(hex_)
            self._evict_locked(0)
        return path

    def pin(self, owner: str, hexes: Iterable[str]) -> None:
        """`owner` needs these chunks (present or to come): none of them is evicted until
        unpin(owner). A second pin of the same owner replaces its first (and what it no longer
        holds may be evicted at once)."""
        with self._lock:
            self._unpin_locked(owner)
            pins = frozenset(hexes)
            self._pins[owner] = pins
            self._pinned.update(pins)
            self._evict_locked(0)

    def unpin(self, owner: str) -> None:
        """`owner` needs its chunks no more; the cache evicts down to its limit again."""
        with self._lock:
            self._unpin_locked(owner)
            self._evict_locked(0)

    def _unpin_locked(self, owner: str) -> None:
        self._pinned.subtract(self._pins.pop(owner, frozenset()))
        self._pinned = +self._pinned  # drop the counts at zero

    def evict(self, needed_bytes: int = 0) -> tuple[int, int]:
        """Forget least recently used unpinned chunks until `needed_bytes` more fit under the
        limit (or nothing unpinned is left): (chunks, bytes) removed."""
        with self._lock:
            return self._evict_locked(needed_bytes)

    def _evict_locked(self, needed_bytes: int) -> tuple[int, int]:
        count = freed = 0
        if self._used + needed_bytes <= self.limit_bytes:
            return count, freed
        for hex_ in list(self._index):
            if self._used + needed_bytes <= self.limit_bytes:
                break
            if self._pinned[hex_]:
                continue
            freed += self._drop(hex_)
            count += 1
        self._evicted += count
        return count, freed

    def collect(self, keep: Iterable[str]) -> tuple[int, int]:
        """Remove every unpinned chunk not in `keep` (the chunks of layers that are still
        wanted): (chunks, bytes) removed."""
        keep = set(keep)
        with self._lock:
            gone = [h for h in self._index if h not in keep and not self._pinned[h]]
            freed = sum(self._drop(h) for h in gone)
            self._evicted += len(gone)
        return len(gone), freed

    def discard(self, hex_: str) -> bool:
        """Remove one chunk (pinned or not); False if the cache did not have it."""
        with self._lock:
            if hex_ not in self._index:
                return False
            self._drop(hex_)
            return True

    def _drop(self, hex_: str) -> int:
        size = self._index.pop(hex_)
        self._used -= size
        unlink_quietly(self.path(hex_))
        return size

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                limit_bytes=self.limit_bytes,
                used_bytes=self._used,
                chunks=len(self._index),
                evicted_chunks=self._evicted,
                corrupt_chunks=self._corrupt,
            )


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # the LRU order, kept across a restart
    except FileNotFoundError:
        pass


def unlink_quietly(path: Path) -> None:
    """Remove a file that may be gone already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
