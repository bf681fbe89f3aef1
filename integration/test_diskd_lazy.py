"""diskd's lazy memory handler against a real userfaultfd and a real object store (moto_server):
a process that restores as Firecracker's Uffd backend does (integration/uffd_vmm.py) reads its
memory page by page as diskd serves it; removed pages come back zero; fillMemory copies in the
rest; a kill -9 of diskd mid-serving and a new diskd that takes the userfaultfd back and serves
on; a chunk that cannot be had fails the VMM (killed, with the reason). No microVM: no machine
lock needed (the Firecracker test kernel's restore is in integration/test_firecracker_uffd.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _owner import OWNER, kill_now
from diskd_proc import DiskdProc
from moto_s3 import MotoS3, moto_s3

from feos.disk._chunks import CHUNK_SIZE
from feos.errors import Code, FeosError

MIB = 1 << 20
HERE = Path(__file__).resolve().parent
REGIONS = (16 * MIB, 8 * MIB)  # two regions, as a VMM with a memory hole has


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as server:
        yield server


def snapshot(path: Path) -> bytes:
    """A memory file laid out as REGIONS: a pattern, and a chunk of zeroes in each region."""
    data = bytearray()
    for page in range(sum(REGIONS) // 4096):
        data += page.to_bytes(8, "little") * 512
    data[CHUNK_SIZE:2 * CHUNK_SIZE] = bytes(CHUNK_SIZE)
    data[5 * CHUNK_SIZE:6 * CHUNK_SIZE] = bytes(CHUNK_SIZE)
    path.write_bytes(data)
    return bytes(data)


class Vmm:
    def __init__(self, socket: Path) -> None:
        env = dict(os.environ, PYTHONPATH=f"{Path.cwd()}{os.pathsep}{HERE}")
        self.proc = OWNER.popen([sys.executable, str(HERE / "uffd_vmm.py"), str(socket),
                                 *map(str, REGIONS)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
        assert self.ask("") == "ready"

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def read(self, offset: int, length: int) -> str:
        return self.ask(f"read {offset} {length}")

    def end(self) -> None:
        kill_now(self.proc)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def served(diskd: DiskdProc, pod: str) -> dict[str, Any]:
    server: dict[str, Any] = diskd.call("getMemoryServer", id=pod)["server"]
    return server


def until(diskd: DiskdProc, pod: str, state: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (server := served(diskd, pod))["state"] != state:
        assert time.monotonic() < deadline, server
        time.sleep(0.05)
    return server


@pytest.fixture
def setup(s3: MotoS3, tmp_path: Path, request: pytest.FixtureRequest
          ) -> Iterator[tuple[DiskdProc, bytes, str, Path]]:  # fmt: skip
    env = s3.env(S3_PREFIX=request.node.name)
    data = snapshot(tmp_path / "memory.snap")
    with DiskdProc(tmp_path / "one", env=env).start() as pusher:
        digest = pusher.call("pushMemory", id="p", path=str(tmp_path / "memory.snap"))["memory"]
    with DiskdProc(tmp_path / "two", env=env).start() as diskd:
        yield diskd, data, digest["digest"], tmp_path / "memory.sock"


def test_pages_come_as_faulted_removed_ones_zero_and_fill_completes(
    setup: tuple[DiskdProc, bytes, str, Path]
) -> None:
    diskd, data, digest, sock = setup
    server = diskd.call("serveMemory", id="pod-l", digest=digest, socket=str(sock),
                        ownerUid=0)["server"]  # fmt: skip
    assert server["state"] == "listening" and sock.exists()
    vmm = Vmm(sock)
    try:
        server = until(diskd, "pod-l", "serving")
        assert server["vmmPid"] == vmm.proc.pid and server["pagesTotal"] == sum(REGIONS) // 4096
        for offset in (0, 3 * MIB + 4096, CHUNK_SIZE + 8192, 17 * MIB, sum(REGIONS) - 4096):
            assert vmm.read(offset, 4096) == sha(data[offset:offset + 4096]), offset
        server = served(diskd, "pod-l")
        assert 0 < server["faults"] <= 5 and 0 < server["pagesIn"] < server["pagesTotal"]
        assert vmm.ask(f"remove {12 * MIB} {2 * 4096}") == "ok"
        assert vmm.read(12 * MIB, 2 * 4096) == sha(bytes(2 * 4096))  # removed: zero pages
        server = diskd.call("fillMemory", id="pod-l")["server"]
        assert server["state"] == "filled"
        want = data[:12 * MIB] + bytes(8192) + data[12 * MIB + 8192:]
        assert vmm.read(0, REGIONS[0]) == sha(want[:REGIONS[0]])
        assert vmm.read(REGIONS[0], REGIONS[1]) == sha(want[REGIONS[0]:])
        assert served(diskd, "pod-l")["faults"] == server["faults"]  # nothing faulted after
    finally:
        vmm.end()
    server = until(diskd, "pod-l", "ended")
    assert "ended" in server["reason"]
    diskd.call("stopMemory", id="pod-l")
    with pytest.raises(FeosError) as caught:
        diskd.call("getMemoryServer", id="pod-l")
    assert caught.value.code is Code.NOT_FOUND


def test_a_restarted_diskd_takes_the_userfaultfd_back_and_serves_on(
    setup: tuple[DiskdProc, bytes, str, Path]
) -> None:
    diskd, data, digest, sock = setup
    diskd.call("serveMemory", id="pod-r", digest=digest, socket=str(sock), ownerUid=0)
    vmm = Vmm(sock)
    try:
        until(diskd, "pod-r", "serving")
        assert vmm.read(0, 4096) == sha(data[:4096])
        diskd.kill()
        diskd.start()
        server = served(diskd, "pod-r")
        assert server["recovered"] and server["state"] == "serving", server
        assert vmm.read(20 * MIB, 3 * 4096) == sha(data[20 * MIB:20 * MIB + 3 * 4096])
        assert vmm.read(0, 8 * MIB) == sha(data[:8 * MIB])  # pages in before and after
        assert diskd.call("fillMemory", id="pod-r")["server"]["state"] == "filled"
    finally:
        vmm.end()


def test_a_chunk_that_cannot_be_had_fails_the_vmm_with_the_reason(
    s3: MotoS3, setup: tuple[DiskdProc, bytes, str, Path], request: pytest.FixtureRequest
) -> None:
    diskd, data, digest, sock = setup
    client = s3.client()
    prefix = f"{request.node.name}/chunks/"
    chunk = sha(data[2 * CHUNK_SIZE:3 * CHUNK_SIZE])
    client.delete_object(Bucket=s3.bucket, Key=prefix + chunk)
    diskd.call("serveMemory", id="pod-f", digest=digest, socket=str(sock), ownerUid=0)
    vmm = Vmm(sock)
    try:
        until(diskd, "pod-f", "serving")
        assert vmm.read(2 * CHUNK_SIZE, 4096) == ""  # killed while it waited on the page
        assert vmm.proc.wait(timeout=30) == -9
        server = until(diskd, "pod-f", "failed")
        assert "is missing" in server["reason"] and "VMM was killed" in server["reason"]
    finally:
        vmm.end()
    diskd.kill()
    diskd.start()
    assert served(diskd, "pod-f")["state"] == "failed"  # its reason outlives diskd
