"""diskd's memory snapshots with a real object store (moto_server on loopback): a snapshot
pushed by one diskd, its progress read while it moves, pulled whole by another and identical;
chunks of zeroes not stored; an abandoned push puts no manifest; a missing, damaged or partial
snapshot refused with its status and no file left. No microVM: no machine lock needed."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diskd_proc import DiskdProc
from moto_s3 import MotoS3, moto_s3

from feos.disk._chunks import CHUNK_SIZE
from feos.errors import Code, FeosError

MIB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def diskd(s3: MotoS3, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DiskdProc]:
    with DiskdProc(tmp_path / "one", env=s3.env(S3_PREFIX=request.node.name)).start() as proc:
        yield proc


def snapshot(path: Path, data_chunks: int, zero_chunks: int) -> str:
    """A memory file of random chunks with zero chunks between them; its sha256 hex."""
    with open(path, "wb") as f:
        for i in range(data_chunks + zero_chunks):
            f.write(os.urandom(CHUNK_SIZE) if i % 2 == 0 and i // 2 < data_chunks
                    else bytes(CHUNK_SIZE))  # fmt: skip
        f.write(b"tail" * 1000)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def keys(s3: MotoS3, prefix: str) -> list[str]:
    answer = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return [o["Key"] for o in answer.get("Contents", [])]


def watch(diskd: DiskdProc, transfer_id: str, until: concurrent.futures.Future[Any]
          ) -> list[dict[str, Any]]:  # fmt: skip
    """memoryTransfer read while `until` runs: the readings seen."""
    seen = []
    while not until.done():
        try:
            seen.append(diskd.call("memoryTransfer", id=transfer_id)["transfer"])
        except FeosError as exc:
            assert exc.code is Code.NOT_FOUND  # not begun yet, or ended
        time.sleep(0.01)
    return seen


def test_a_snapshot_travels_whole_and_its_zeroes_stay_home(
    s3: MotoS3, diskd: DiskdProc, tmp_path: Path
) -> None:
    source = tmp_path / "memory.snap"
    hex_ = snapshot(source, data_chunks=12, zero_chunks=12)
    size = source.stat().st_size
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(diskd.call, "pushMemory", id="pod-a", path=str(source))
        seen = watch(diskd, "pod-a", pushing)
        memory = pushing.result()["memory"]
    assert memory == {"digest": f"sha256:{hex_}", "sizeBytes": size, "chunks": 25,
                      "storedChunks": 13}  # fmt: skip
    assert seen and all(s["direction"] == "push" for s in seen)
    assert all(s["bytesTotal"] in (0, size) and 0 <= s["bytesDone"] <= s["bytesTotal"]
               for s in seen)  # fmt: skip
    assert any(0 < s["bytesDone"] for s in seen)
    prefix = f"{test_a_snapshot_travels_whole_and_its_zeroes_stay_home.__name__}/"
    assert keys(s3, prefix + "memory/") == [f"{prefix}memory/{hex_}.json"]
    assert len(keys(s3, prefix + "chunks/")) == 13  # the twelve random and the tail
    with pytest.raises(FeosError) as caught:
        diskd.call("memoryTransfer", id="pod-a")
    assert caught.value.code is Code.NOT_FOUND

    env = s3.env(S3_PREFIX=prefix.rstrip("/"))
    with DiskdProc(tmp_path / "two", env=env).start() as two:
        dest = tmp_path / "restored" / "memory"
        dest.parent.mkdir()
        pulled = two.call("pullMemory", id="pod-a", digest=memory["digest"], path=str(dest),
                          ownerUid=4242)["memory"]  # fmt: skip
        assert pulled == memory
        assert hashlib.sha256(dest.read_bytes()).hexdigest() == hex_
        st = dest.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (4242, 0o600)
        assert st.st_blocks * 512 < size - 10 * CHUNK_SIZE  # its zero chunks are holes


def test_an_abandoned_push_puts_no_manifest(
    s3: MotoS3, diskd: DiskdProc, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    source = tmp_path / "memory.snap"
    snapshot(source, data_chunks=48, zero_chunks=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(diskd.call, "pushMemory", id="pod-b", path=str(source))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not pushing.done():
            try:
                if diskd.call("memoryTransfer", id="pod-b")["transfer"]["bytesDone"] > 0:
                    break
            except FeosError:
                pass
            time.sleep(0.01)
        diskd.call("abandonMemory", id="pod-b")
        with pytest.raises(FeosError) as caught:
            pushing.result()
    assert caught.value.code is Code.ABORTED
    assert keys(s3, f"{request.node.name}/memory/") == []
    with pytest.raises(FeosError) as caught:
        diskd.call("abandonMemory", id="pod-b")
    assert caught.value.code is Code.NOT_FOUND


def test_a_bad_snapshot_is_refused_and_leaves_no_file(
    s3: MotoS3, diskd: DiskdProc, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    source = tmp_path / "memory.snap"
    snapshot(source, data_chunks=3, zero_chunks=2)
    memory = diskd.call("pushMemory", id="pod-c", path=str(source))["memory"]
    dest_dir = tmp_path / "restored"
    dest_dir.mkdir()

    def refused(code: Code, digest: str = memory["digest"]) -> str:
        with pytest.raises(FeosError) as caught:
            diskd.call("pullMemory", id="pod-c", digest=digest, path=str(dest_dir / "memory"))
        assert caught.value.code is code, caught.value.message
        assert list(dest_dir.iterdir()) == []  # nothing half made
        return caught.value.message

    assert "has no memory snapshot" in refused(Code.NOT_FOUND, "sha256:" + "2" * 64)
    client, chunks = s3.client(), sorted(keys(s3, f"{request.node.name}/chunks/"))
    client.put_object(Bucket=s3.bucket, Key=chunks[0], Body=b"not what it was")
    (diskd.state_dir / "cache").mkdir(exist_ok=True)
    for cached in (diskd.state_dir / "cache").iterdir():
        cached.unlink()  # the push cached nothing, but be sure the store is what is read
    assert "does not match its digest" in refused(Code.DATA_LOSS)
    client.delete_object(Bucket=s3.bucket, Key=chunks[0])
    assert "is missing" in refused(Code.DATA_LOSS)
    manifest = keys(s3, f"{request.node.name}/memory/")[0]
    client.put_object(Bucket=s3.bucket, Key=manifest, Body=b'{"digest": 1}')
    assert "memory manifest" in refused(Code.DATA_LOSS)
    with pytest.raises(FeosError) as caught:
        diskd.call("pullMemory", id="pod-c", digest=memory["digest"], path="relative")
    assert caught.value.code is Code.INVALID_ARGUMENT
