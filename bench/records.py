"""Acknowledged CreateVolume calls through feosd's API, beside raw synced writes of 4 KiB files.

feosd runs as a process on a temporary state directory; the clients are pycapnp on asyncio, as
feosctl is. The raw figure is what the same filesystem does for a record file that survives a
crash: write 4 KiB to a temporary file, fsync it, rename it over the record, fsync the
directory, one after the other from one thread. Then ten clients at once, each with its own
connection, beside one: their changes share the journal's syncs. The rounds are short and many,
each raw, one client, ten clients within a second or two, with a pause between the parts (what
one part leaves, such as feosd's folder writing the last creates into their files, is done
before the next part is timed); each ratio is the median over the rounds of that round's ratio,
so that a neighbour's load, which comes and goes over seconds, falls on both of its sides.

feosd and the temporary directory are removed on any exit, SIGTERM and SIGINT included; a
SIGKILL of the bench still ends feosd (its parent-death signal), leaving only the directory.

Where a record's time goes (one client, this machine): an acknowledged create waits for one
append to the records' journal and its fdatasync (feos/records.py), not for the record file's
write, fsync, rename and directory fsync (the raw figure), which the folder does in the
background, in the writer's pauses (the pauses between the parts here): a fold in the middle of
a part queued the journal's syncs behind its files' cache flushes. The rest is the API: pycapnp's
round trip on both sides (bench/api.py's echo) and feosd's work on the Cap'n Proto thread, which
with ten clients is the bound, with the CPU the neighbours leave. docs/operations.md ("The state
directory") has the figures.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import capnp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from feos.errors import FeosError  # noqa: E402
from feos.rpc._client import Client  # noqa: E402

ROUNDS = 9
CREATES = 200  # per round from one client
TEN = 10
PER_CLIENT = 40  # per round from each of the ten
RAW = 200  # raw synced writes per round
SETTLE = 0.3
"""Seconds between two parts of a round: what one leaves to do (feosd's folder writing the
last creates into their files, the filesystem's commit of the raw files' removal) is done
before the next is timed, not in it."""


def raw_synced_writes(directory: Path, count: int) -> float:
    """Records a second that write+fsync+rename+directory fsync keeps, one after the other."""
    directory.mkdir(exist_ok=True)
    data = os.urandom(4096)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        start = time.perf_counter()
        for i in range(count):
            tmp, final = directory / f".{i}.tmp", directory / f"{i}.pb"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            os.fsync(dir_fd)
        return count / (time.perf_counter() - start)
    finally:
        os.close(dir_fd)
        shutil.rmtree(directory, ignore_errors=True)


async def creates(client: Client, count: int) -> None:
    for _ in range(count):
        await client.call("volumes", "createVolume", id=str(uuid.uuid4()), sizeBytes=64 << 20)


async def one_client(client: Client) -> float:
    start = time.perf_counter()
    await creates(client, CREATES)
    return CREATES / (time.perf_counter() - start)


async def ten_clients(clients: list[Client]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(creates(c, PER_CLIENT) for c in clients))
    return TEN * PER_CLIENT / (time.perf_counter() - start)


def wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"feosd did not make {path}")
        time.sleep(0.05)


def _die_with_parent() -> None:
    """In feosd's child before exec: a SIGTERM when the bench ends, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_feosd(tmpdir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "feosd"), "--state-dir", str(tmpdir / "state"),
         "--run-dir", str(tmpdir / "run"), "--log-level", "WARNING"],
        start_new_session=True, preexec_fn=_die_with_parent)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def connect(api: Path) -> Client:
    """A client, once feosd listens (its socket exists a moment before it does)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await Client.connect(str(api))
        except FeosError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def measure(tmpdir: Path, api: Path) -> tuple[float, float]:
    """The medians over the rounds of each round's ratios: one client's creates / raw writes, ten
    clients' / one client's (a round's figures are taken within a second of each other, so the
    neighbours' load, which comes and goes over seconds, falls on both sides of its ratios)."""
    one = await connect(api)
    many = [await connect(api) for _ in range(TEN)]
    try:
        await creates(one, 50)  # warm: the first calls load code paths
        raws, ones, tens = [], [], []
        for _ in range(ROUNDS):
            await asyncio.sleep(SETTLE)
            raws.append(raw_synced_writes(tmpdir / "state" / "raw", RAW))
            await asyncio.sleep(SETTLE)
            ones.append(await one_client(one))
            await asyncio.sleep(SETTLE)
            tens.append(await ten_clients(many))
        print(f"raw synced writes: {', '.join(f'{r:.0f}' for r in raws)} /s")
        print(f"CreateVolume from one client: {', '.join(f'{r:.0f}' for r in ones)} /s")
        print(f"CreateVolume from ten clients: {', '.join(f'{r:.0f}' for r in tens)} /s")
        return (
            statistics.median(o / r for o, r in zip(ones, raws, strict=True)),
            statistics.median(t / o for t, o in zip(tens, ones, strict=True)),
        )
    finally:
        for client in (one, *many):
            client.close()


async def main(tmpdir: Path) -> None:
    feosd = start_feosd(tmpdir)
    try:
        wait_for(tmpdir / "run" / "api.sock", feosd)
        one_to_raw, ten_to_one = await measure(tmpdir, tmpdir / "run" / "api.sock")
    finally:
        stop(feosd)
    print(f"ratio acknowledged creates / raw synced writes: {one_to_raw:.2f} (target >= 0.8)")
    print(f"ratio ten clients / one client: {ten_to_one:.2f} (target >= 3)")


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    with tempfile.TemporaryDirectory(prefix="feos-bench-records-") as tmp:
        asyncio.run(capnp.run(main(Path(tmp))))
