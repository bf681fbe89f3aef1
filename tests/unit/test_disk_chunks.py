"""Layers cut into chunks (holes found without reading, zero chunks as holes) and the chunk
cache on a real directory: verification on insert and on read, LRU eviction, pins, the limit,
and a restart that recounts what is there."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from feos.disk._chunks import (
    CHUNK_SIZE,
    ChunkCache,
    chunk_hex,
    is_zero,
    read_chunks,
)
from feos.errors import Code, FeosError

SMALL = 4096


def chunks_of(path: Path, chunk_size: int = CHUNK_SIZE) -> list[bytes | None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [c.data for c in read_chunks(fd, os.fstat(fd).st_size, chunk_size)]
    finally:
        os.close(fd)


def test_a_sparse_layer_is_mostly_holes(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    with open(layer, "wb") as f:
        f.write(b"a" * 10)  # chunk 0: data then zeroes
        f.seek(2 * CHUNK_SIZE)
        f.write(bytes(CHUNK_SIZE))  # chunk 2: written zeroes, allocated
        f.seek(5 * CHUNK_SIZE - 1)
        f.write(b"z")  # chunk 4: data at its very end
        f.truncate(6 * CHUNK_SIZE + 100)  # chunk 6: a short hole at the end
    got = chunks_of(layer)
    assert [c is not None for c in got] == [True, False, False, False, True, False, False]
    assert got[0] == b"a" * 10 + bytes(CHUNK_SIZE - 10)
    assert got[4] == bytes(CHUNK_SIZE - 1) + b"z"


@given(st.lists(st.tuples(st.integers(0, 20 * SMALL), st.binary(min_size=1, max_size=300)),
                max_size=6), st.integers(0, 24 * SMALL))  # fmt: skip
def test_chunks_put_back_are_the_file(writes: list[tuple[int, bytes]], size: int) -> None:
    image = bytearray(size)
    for offset, data in writes:
        end = offset + len(data)
        if end > len(image):
            image.extend(bytes(end - len(image)))
        image[offset:end] = data
    fd = os.memfd_create("layer")  # a real file with holes and SEEK_DATA, on tmpfs
    try:
        for offset, data in writes:
            os.pwrite(fd, data, offset)
        os.ftruncate(fd, len(image))
        rebuilt = bytearray()
        for chunk in read_chunks(fd, len(image), SMALL):
            assert chunk.offset == len(rebuilt)
            assert chunk.data is None or not is_zero(chunk.data)
            rebuilt += bytes(chunk.length) if chunk.data is None else chunk.data
        assert rebuilt == image
    finally:
        os.close(fd)


def chunk(n: int, size: int = 1000) -> tuple[str, bytes]:
    data = n.to_bytes(4, "big") * (size // 4)
    return chunk_hex(data), data


def test_put_verifies_and_get_finds(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", 10_000)
    hex_, data = chunk(1)
    with pytest.raises(FeosError) as caught:
        cache.put(hex_, data + b"!")
    assert caught.value.code == Code.DATA_LOSS and hex_ in caught.value.message
    assert cache.get(hex_) is None and os.listdir(tmp_path / "c") == []
    path = cache.put(hex_, data)
    assert cache.get(hex_) == path and path.read_bytes() == data and cache.read(hex_) == data
    assert cache.stats().used_bytes == 1000 and cache.stats().chunks == 1
    cache.put(hex_, data)  # again: counted once
    assert cache.stats().used_bytes == 1000


def test_a_damaged_chunk_is_not_served(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 10_000)
    hex_, data = chunk(1)
    path = cache.put(hex_, data)
    os.chmod(path, 0o600)
    path.write_bytes(b"x" * len(data))  # same size: get's cheap check passes
    assert cache.get(hex_) == path
    assert cache.read(hex_) is None  # read's full check does not
    assert cache.get(hex_) is None and not path.exists()
    assert cache.stats().corrupt_chunks == 1 and cache.stats().used_bytes == 0
    cache.put(hex_, data)
    path.write_bytes(data[:10])  # shortened: get's size check drops it
    assert cache.get(hex_) is None and cache.stats().chunks == 0


def test_eviction_is_least_recently_used_first(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 3000)
    (h1, d1), (h2, d2), (h3, d3), (h4, d4) = (chunk(n) for n in range(1, 5))
    cache.put(h1, d1), cache.put(h2, d2), cache.put(h3, d3)
    assert cache.get(h1) is not None  # 1 is used: 2 is now the oldest
    cache.put(h4, d4)
    assert h2 not in cache and all(h in cache for h in (h1, h3, h4))
    stats = cache.stats()
    assert (stats.chunks, stats.used_bytes, stats.evicted_chunks) == (3, 3000, 1)
    assert cache.evict(needed_bytes=1500) == (2, 2000)  # 3 then 1 go; 4, the newest, stays
    assert h4 in cache and h3 not in cache and h1 not in cache


def test_pins_keep_chunks_over_the_limit_until_unpinned(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 2000)
    (h1, d1), (h2, d2), (h3, d3) = (chunk(n) for n in range(1, 4))
    cache.pin("layer-a", [h1, h2])
    cache.pin("disk-b", [h2])
    cache.put(h1, d1), cache.put(h2, d2), cache.put(h3, d3)
    assert cache.stats().used_bytes == 2000 and h3 not in cache  # the newest, but not pinned
    cache.put(h3, d3)
    assert h1 in cache and h2 in cache
    cache.pin("disk-c", [h3])
    cache.put(h3, d3)
    assert cache.stats().used_bytes == 3000  # over the limit by what is pinned
    cache.unpin("layer-a")  # 1 goes; 2 is still disk-b's
    assert h1 not in cache and h2 in cache and h3 in cache
    assert cache.collect(keep=[]) == (0, 0)  # everything left is pinned
    cache.unpin("disk-b"), cache.unpin("disk-c"), cache.unpin("nobody")
    assert cache.collect(keep=[h3]) == (1, 1000) and h3 in cache


def test_a_restart_recounts_and_clears_leftovers(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 10_000)
    chunks = [chunk(n) for n in range(1, 5)]
    for i, (hex_, data) in enumerate(chunks):
        path = cache.put(hex_, data)
        os.utime(path, ns=(i * 10**9, i * 10**9))  # the order of use, as hits keep it
    (tmp_path / f".{chunks[0][0]}.1.2.tmp").write_bytes(b"cut off")
    (tmp_path / "lost+found").mkdir()
    again = ChunkCache(tmp_path, 2000)  # a smaller limit: the two least used go at once
    stats = again.stats()
    assert (stats.chunks, stats.used_bytes, stats.evicted_chunks) == (2, 2000, 2)
    assert [h in again for h, _ in chunks] == [False, False, True, True]
    assert sorted(os.listdir(tmp_path)) == sorted([chunks[2][0], chunks[3][0], "lost+found"])


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FeosError) as caught:
        ChunkCache(tmp_path, -1)
    assert caught.value.code == Code.INVALID_ARGUMENT


# -- the cache under hypothesis's operations, and under threads

SIZES = (700, 1000, 1300)
CHUNKS = [chunk(n, SIZES[n % 3]) for n in range(12)]


class CacheMachine(RuleBasedStateMachine):
    """Puts, hits, pins, unpins, evictions, collects and restarts in any order: the index is
    the directory, the limit holds but for what is pinned, and a pinned chunk that went in stays."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="feos-cache-"))
        self.limit = 3000
        self.cache = ChunkCache(self.dir, self.limit)
        self.pins: dict[str, set[int]] = {}
        self.kept: set[int] = set()  # pinned chunks put since their pin: must be there

    def pinned(self) -> set[int]:
        return set().union(*self.pins.values()) if self.pins else set()

    @rule(n=st.integers(0, 11))
    def put(self, n: int) -> None:
        self.cache.put(*CHUNKS[n])
        if n in self.pinned():
            self.kept.add(n)

    @rule(n=st.integers(0, 11))
    def read(self, n: int) -> None:
        data = self.cache.read(CHUNKS[n][0])
        assert data is None or data == CHUNKS[n][1]
        assert data is not None or n not in self.kept

    @rule(owner=st.sampled_from("abc"), ns=st.sets(st.integers(0, 11), max_size=3))
    def pin(self, owner: str, ns: set[int]) -> None:
        self.cache.pin(owner, [CHUNKS[n][0] for n in ns])
        self.pins[owner] = ns
        self.kept &= self.pinned()
        self.kept |= {n for n in ns if CHUNKS[n][0] in self.cache}

    @rule(owner=st.sampled_from("abc"))
    def unpin(self, owner: str) -> None:
        self.cache.unpin(owner)
        self.pins.pop(owner, None)
        self.kept &= self.pinned()

    @rule(needed=st.integers(0, 4000))
    def evict(self, needed: int) -> None:
        self.cache.evict(needed)

    @rule(keep=st.sets(st.integers(0, 11)))
    def collect(self, keep: set[int]) -> None:
        self.cache.collect(CHUNKS[n][0] for n in keep)

    @rule()
    def restart(self) -> None:  # pins live in diskd's memory: a restart has none
        self.cache = ChunkCache(self.dir, self.limit)
        self.pins.clear()
        self.kept.clear()

    @invariant()
    def the_index_is_the_directory(self) -> None:
        stats = self.cache.stats()
        files = {p.name: p.stat().st_size for p in self.dir.iterdir()}
        assert set(files) == {h for h, _ in CHUNKS if h in self.cache}
        assert stats.chunks == len(files) and stats.used_bytes == sum(files.values())
        assert all(CHUNKS[n][0] in self.cache for n in self.kept)
        unpinned = {h for h, _ in CHUNKS if h in self.cache} - {CHUNKS[n][0] for n in self.pinned()}
        assert stats.used_bytes <= self.limit or not unpinned

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


TestCacheMachine = CacheMachine.TestCase


def test_threads_at_once_keep_the_index_true(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 5000)

    def work(seed: int) -> None:
        for i in range(200):
            n = (seed * 7 + i) % len(CHUNKS)
            if i % 5 == 0:
                cache.pin(f"owner-{seed}", [CHUNKS[n][0]])
            elif i % 5 == 1:
                cache.unpin(f"owner-{seed}")
            cache.put(*CHUNKS[n])
            data = cache.read(CHUNKS[(n + 3) % len(CHUNKS)][0])
            assert data is None or chunk_hex(data) == CHUNKS[(n + 3) % len(CHUNKS)][0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    for seed in range(8):
        cache.unpin(f"owner-{seed}")
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    stats = cache.stats()
    assert stats.chunks == len(files) and stats.used_bytes == sum(files.values()) <= 5000
