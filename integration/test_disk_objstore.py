"""The object store against a real S3 endpoint (moto_server on loopback): push and pull of sparse
multi-chunk layers, nothing uploaded twice, corrupted chunks in the store and in the cache, a
refusing bucket and endpoints that do not answer. No microVM: no machine lock needed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from moto_s3 import MotoS3, free_port, moto_s3

from feos.disk._chunks import CHUNK_SIZE, ChunkCache
from feos.disk._objstore import LayerManifest, ObjectStore, StoreConfig, layer_file_name
from feos.errors import Code, FeosError

# Short enough that a test of a silent endpoint ends in seconds, long enough for a loaded machine.
QUICK = {"connect_timeout_s": 2.0, "read_timeout_s": 2.0, "retry_delay_s": 0.1}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as server:
        # versions count the PUTs: a key written twice has two
        server.client().put_bucket_versioning(
            Bucket=server.bucket, VersioningConfiguration={"Status": "Enabled"})
        yield server


@pytest.fixture
def store(s3: MotoS3, request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    """A store of the test's own: its name is its key prefix."""
    config, reason = StoreConfig.from_env(s3.env(S3_PREFIX=request.node.name))
    assert config is not None, reason
    with ObjectStore(attrs.evolve(config, **QUICK)) as store:
        yield store


def make_layer(path: Path, pieces: dict[int, bytes], size: int) -> str:
    """A sparse file with `pieces` at their offsets; its digest."""
    with open(path, "wb") as f:
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
        f.truncate(size)
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_for(digest: str) -> LayerManifest:
    return LayerManifest(digest=digest, parent="", size_bytes=0, virtual_bytes=1 << 30,
                         guest="0.1.0", image="", format="raw",
                         created_unix_ns=time.time_ns())  # fmt: skip


@pytest.fixture
def layer(tmp_path: Path) -> tuple[Path, str]:
    """Ten chunks and a bit: three of data (two the same), the rest holes or zeroes."""
    same = os.urandom(CHUNK_SIZE)
    path = tmp_path / "src" / "layer.img"
    path.parent.mkdir()
    digest = make_layer(path, {0: b"boot" * 100, 3 * CHUNK_SIZE: same, 7 * CHUNK_SIZE: same,
                               9 * CHUNK_SIZE: bytes(CHUNK_SIZE)}, 10 * CHUNK_SIZE + 4097)  # fmt: skip
    return path, digest


def objects(s3: MotoS3, prefix: str) -> dict[str, int]:
    """Key -> number of versions (PUTs) under the prefix."""
    versions: dict[str, int] = {}
    answer = s3.client().list_object_versions(Bucket=s3.bucket, Prefix=prefix)
    for version in answer.get("Versions", []):
        versions[version["Key"]] = versions.get(version["Key"], 0) + 1
    return versions


def pull_dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def test_push_then_pull_gives_the_same_file(store: ObjectStore, s3: MotoS3, tmp_path: Path,
                                            layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    pushed = store.push_layer(path, manifest_for(digest))
    assert pushed.size_bytes == path.stat().st_size and pushed.chunk_size == CHUNK_SIZE
    assert [c is not None for c in pushed.chunks] == [i in (0, 3, 7) for i in range(11)]
    assert pushed.chunks[3] == pushed.chunks[7]
    prefix = store.config.prefix
    assert objects(s3, prefix) == {f"{prefix}chunks/{pushed.chunks[0]}": 1,
                                   f"{prefix}chunks/{pushed.chunks[3]}": 1,
                                   f"{prefix}layers/{digest[7:]}.json": 1}  # fmt: skip
    assert store.has_layer(digest) and store.get_manifest(digest) == pushed

    dest = pull_dir(tmp_path, "layers")
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    assert store.pull_layer(digest, cache, dest) == pushed
    pulled = dest / layer_file_name(digest)
    assert pulled.read_bytes() == path.read_bytes()
    assert os.listdir(dest) == [pulled.name]  # no temporary file left
    assert pulled.stat().st_mode & 0o777 == 0o444
    assert pulled.stat().st_blocks * 512 <= 3 * CHUNK_SIZE  # the holes stay holes
    assert cache.stats().chunks == 2 and cache.stats().used_bytes == 2 * CHUNK_SIZE


def test_a_second_push_uploads_nothing(store: ObjectStore, s3: MotoS3,
                                       layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    first = store.push_layer(path, manifest_for(digest))
    before = objects(s3, store.config.prefix)
    again = store.push_layer(path, manifest_for(digest))  # another created_unix_ns: same layer
    assert objects(s3, store.config.prefix) == before and set(before.values()) == {1}
    assert again.chunks == first.chunks


def test_a_file_that_is_not_its_digest_is_not_pushed(store: ObjectStore, s3: MotoS3,
                                                     layer: tuple[Path, str]) -> None:  # fmt: skip
    path, _ = layer
    with pytest.raises(FeosError) as caught:
        store.push_layer(path, manifest_for("sha256:" + "0" * 64))
    assert caught.value.code == Code.DATA_LOSS and str(path) in caught.value.message
    assert not store.has_layer("sha256:" + "0" * 64)
    assert not any(k.endswith(".json") for k in objects(s3, store.config.prefix))


def test_a_layer_the_store_lacks(store: ObjectStore, tmp_path: Path) -> None:
    missing = "sha256:" + "e" * 64
    assert not store.has_layer(missing)
    with pytest.raises(FeosError) as caught:
        store.pull_layer(missing, ChunkCache(tmp_path / "cache", 1 << 20), tmp_path)
    assert caught.value.code == Code.NOT_FOUND and missing in caught.value.message


@pytest.mark.parametrize("size", [CHUNK_SIZE, 2 * CHUNK_SIZE + 1, 10])
def test_a_corrupted_chunk_in_the_store_is_refused(store: ObjectStore, s3: MotoS3,
                                                   tmp_path: Path, layer: tuple[Path, str],
                                                   caplog: pytest.LogCaptureFixture,
                                                   size: int) -> None:  # fmt: skip
    path, digest = layer
    pushed = store.push_layer(path, manifest_for(digest))
    bad = pushed.chunks[3]
    assert bad is not None
    s3.client().put_object(Bucket=s3.bucket, Key=store.chunk_key(bad), Body=os.urandom(size))
    dest = pull_dir(tmp_path, "layers")
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    with caplog.at_level(logging.WARNING), pytest.raises(FeosError) as caught:
        store.pull_layer(digest, cache, dest)
    assert caught.value.code == Code.DATA_LOSS
    assert bad in caught.value.message and "after 3 tries" in caught.value.message
    assert sum(bad in r.getMessage() and "refused" in r.getMessage()
               for r in caplog.records) == 3  # fmt: skip
    assert os.listdir(dest) == []  # no layer, no half of one
    assert bad not in cache


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"{not json", "not JSON"), (b'{"digest": 1}', "field"), (None, "describes sha256:")],
)
def test_a_damaged_manifest_is_data_loss(store: ObjectStore, s3: MotoS3, tmp_path: Path,
                                         layer: tuple[Path, str], body: bytes | None,
                                         says: str) -> None:  # fmt: skip
    path, digest = layer
    pushed = store.push_layer(path, manifest_for(digest))
    other = attrs.evolve(pushed, digest="sha256:" + "f" * 64)
    s3.client().put_object(Bucket=s3.bucket, Key=store.manifest_key(digest),
                           Body=other.to_json() if body is None else body)  # fmt: skip
    dest = pull_dir(tmp_path, "layers")
    with pytest.raises(FeosError) as caught:
        store.pull_layer(digest, ChunkCache(tmp_path / "cache", 64 << 20), dest)
    assert caught.value.code == Code.DATA_LOSS and says in caught.value.message
    assert store.manifest_key(digest) in caught.value.message and os.listdir(dest) == []
    store.push_layer(path, manifest_for(digest))  # a push puts a damaged manifest right
    assert store.get_manifest(digest).chunks == pushed.chunks


def test_a_corrupted_chunk_in_the_cache_is_fetched_again(store: ObjectStore, tmp_path: Path,
                                                         layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    pushed = store.push_layer(path, manifest_for(digest))
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    store.pull_layer(digest, cache, pull_dir(tmp_path, "first"))
    hex_ = pushed.chunks[3]
    assert hex_ is not None
    cached = cache.path(hex_)
    os.chmod(cached, 0o600)
    cached.write_bytes(os.urandom(CHUNK_SIZE))  # same size: only the digest tells
    second = pull_dir(tmp_path, "second")
    store.pull_layer(digest, cache, second)
    assert (second / layer_file_name(digest)).read_bytes() == path.read_bytes()
    assert cache.stats().corrupt_chunks == 1
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == hex_  # fetched and kept again


def test_a_pull_takes_what_the_cache_has(store: ObjectStore, s3: MotoS3, tmp_path: Path,
                                         layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    pushed = store.push_layer(path, manifest_for(digest))
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    store.pull_layer(digest, cache, pull_dir(tmp_path, "first"))
    for hex_ in {c for c in pushed.chunks if c is not None}:
        s3.client().delete_object(Bucket=s3.bucket, Key=store.chunk_key(hex_))
    second = pull_dir(tmp_path, "second")
    store.pull_layer(digest, cache, second)  # the store has only the manifest now
    assert (second / layer_file_name(digest)).read_bytes() == path.read_bytes()


def test_a_stopped_push_or_pull_leaves_nothing(store: ObjectStore, s3: MotoS3, tmp_path: Path,
                                               layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    stop = threading.Event()
    stop.set()
    with pytest.raises(FeosError) as caught:
        store.push_layer(path, manifest_for(digest), stop=stop)
    assert caught.value.code == Code.ABORTED and not store.has_layer(digest)
    store.push_layer(path, manifest_for(digest))
    dest = pull_dir(tmp_path, "layers")
    with pytest.raises(FeosError) as caught:
        store.pull_layer(digest, ChunkCache(tmp_path / "cache", 1 << 20), dest, stop=stop)
    assert caught.value.code == Code.ABORTED and os.listdir(dest) == []


def test_files_that_fail_are_named(store: ObjectStore, tmp_path: Path,
                                   layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    with pytest.raises(FeosError) as caught:
        store.push_layer(tmp_path / "nothing.img", manifest_for(digest))
    assert caught.value.code == Code.NOT_FOUND and "nothing.img" in caught.value.message
    store.push_layer(path, manifest_for(digest))
    with pytest.raises(FeosError) as caught:
        store.pull_layer(digest, ChunkCache(tmp_path / "cache", 64 << 20), tmp_path / "nodir")
    assert caught.value.code == Code.NOT_FOUND and "nodir" in caught.value.message


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "feostest-disk", str(path)],
                   check=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs of its own: needs root")
def test_a_full_disk_fails_the_pull_and_leaves_nothing(store: ObjectStore, tmp_path: Path,
                                                       layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer  # 12 MiB of data to write
    store.push_layer(path, manifest_for(digest))
    with small_filesystem(tmp_path / "small", "6m") as dest:
        with pytest.raises(FeosError) as caught:
            store.pull_layer(digest, ChunkCache(tmp_path / "cache", 64 << 20), dest)
        assert caught.value.code == Code.RESOURCE_EXHAUSTED
        assert "No space left on device" in caught.value.message and digest in caught.value.message
        assert os.listdir(dest) == [] and os.statvfs(dest).f_bfree == os.statvfs(dest).f_blocks


def test_pulls_at_once_share_the_cache(store: ObjectStore, tmp_path: Path,
                                       layer: tuple[Path, str]) -> None:  # fmt: skip
    path, digest = layer
    store.push_layer(path, manifest_for(digest))
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    dests = [pull_dir(tmp_path, f"d{i}") for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda d: store.pull_layer(digest, cache, d), dests))
    for dest in dests:
        assert (dest / layer_file_name(digest)).read_bytes() == path.read_bytes()
    assert cache.stats().chunks == 2


# -- a store that refuses or does not answer: the store's own words, in bounded time


@pytest.fixture
def failing_store() -> Iterator[Callable[..., ObjectStore]]:
    made: list[ObjectStore] = []

    def make(base: StoreConfig, **changes: Any) -> ObjectStore:
        made.append(ObjectStore(attrs.evolve(base, **(QUICK | changes))))
        return made[-1]

    yield make
    for store in made:
        store.close()


def small_layer(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "small.img"
    return path, make_layer(path, {0: b"data"}, 5000)


def assert_fails(store: ObjectStore, tmp_path: Path, says: str, retried: bool) -> None:
    """Push and pull fail with UNAVAILABLE carrying `says`, within what the timeouts allow,
    after three tries or (a refusal another try cannot change) at once."""
    config = store.config
    bound = config.tries * (config.connect_timeout_s + config.read_timeout_s + 1) + 3 * 2
    path, digest = small_layer(tmp_path)
    dest = pull_dir(tmp_path, "dest")
    for attempt in (lambda: store.push_layer(path, manifest_for(digest)),
                    lambda: store.pull_layer(digest, ChunkCache(tmp_path / "c", 1 << 20), dest)):
        started = time.monotonic()
        with pytest.raises(FeosError) as caught:
            attempt()
        # not a speed check: the timeouts are what ends a silent endpoint, and they apply
        assert time.monotonic() - started < bound
        assert caught.value.code == Code.UNAVAILABLE
        assert says in caught.value.message and config.bucket in caught.value.message
        assert ("(after 3 tries)" in caught.value.message) == retried
    assert os.listdir(dest) == []


def test_no_such_bucket(store: ObjectStore, tmp_path: Path,
                        failing_store: Callable[..., ObjectStore]) -> None:  # fmt: skip
    refusing = failing_store(store.config, bucket="no-such-bucket")
    assert_fails(refusing, tmp_path, "NoSuchBucket: The specified bucket does not exist",
                 retried=False)


def test_bad_credentials(tmp_path: Path, failing_store: Callable[..., ObjectStore]) -> None:
    with moto_s3(tmp_path, auth=True) as checking:
        config, _ = StoreConfig.from_env(checking.env(AWS_ACCESS_KEY_ID="AKIANOBODY"))
        assert config is not None
        assert_fails(failing_store(config), tmp_path, "InvalidAccessKeyId", retried=False)


def test_nothing_listens(store: ObjectStore, tmp_path: Path,
                         failing_store: Callable[..., ObjectStore]) -> None:  # fmt: skip
    endpoint = f"http://127.0.0.1:{free_port()}"
    silent = failing_store(store.config, endpoint=endpoint)
    assert_fails(silent, tmp_path, "Could not connect to the endpoint URL", retried=True)


def test_an_endpoint_that_never_answers(store: ObjectStore, tmp_path: Path,
                                        failing_store: Callable[..., ObjectStore]) -> None:  # fmt: skip
    with mute_endpoint() as endpoint:
        mute = failing_store(store.config, endpoint=endpoint, read_timeout_s=1.0)
        assert_fails(mute, tmp_path, "ReadTimeoutError: Read timeout on endpoint URL",
                     retried=True)


@contextlib.contextmanager
def mute_endpoint() -> Iterator[str]:
    """A loopback port that accepts every connection, reads nothing and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: done
            while True:
                held.append(listener.accept()[0])

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(5)
        for conn in held:
            conn.close()
