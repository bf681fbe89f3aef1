"""Round trips of GetVolume and ListVolumes over feosd's Unix socket, beside a raw Cap'n Proto echo.

feosd runs as a process in a temporary directory, holding 10, 1,000 and 10,000 volumes in turn;
the client is pycapnp on asyncio, as feosctl is. The limit is the same machine's round trip of a
raw Cap'n Proto echo over a Unix socket, served by a separate process on pycapnp's asyncio loop:
what any Cap'n Proto API on this stack costs at the least.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import capnp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "integration"))

import _owner  # noqa: E402
from _owner import OWNER  # noqa: E402
from _timing import percentile, timed  # noqa: E402

from feos.rpc._client import Client  # noqa: E402

ECHO_SERVER = f"""
import asyncio, capnp, socket, sys
echo = capnp.load({str(HERE / "_echo.capnp")!r})
class Echo(echo.Echo.Server):
    async def echo(self, id, **kwargs):
        return id
async def main():
    async def on_connect(stream):
        server = capnp.TwoPartyServer(stream, bootstrap=Echo())
        await server.on_disconnect()
    server = await capnp.AsyncIoStream.create_unix_server(on_connect, path=sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(capnp.run(main()))
"""


def wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear")
        time.sleep(0.05)


async def echo_round_trip(path: Path, count: int) -> list[float]:
    echo = capnp.load(str(HERE / "_echo.capnp"))
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(path))
    sock.setblocking(False)
    stream = await capnp.AsyncIoStream.create_connection(sock=sock)
    client = capnp.TwoPartyClient(stream)
    cap = client.bootstrap().cast_as(echo.Echo)
    volume_id = str(uuid.uuid4())

    async def call() -> None:
        await cap.echo(id=volume_id)

    return await timed(call, count, warmup=min(50, count))


async def feosd_round_trips(path: Path, total: int, have: int) -> tuple[list[float], list[float]]:
    client = await Client.connect(str(path))
    ids = []
    for _ in range(total - have):
        volume_id = str(uuid.uuid4())
        await client.call("volumes", "createVolume", id=volume_id, sizeBytes=64 << 20)
        ids.append(volume_id)
    listed = await client.call("volumes", "listVolumes")
    assert len(listed.volumes) == total
    target = listed.volumes[0].id

    async def get() -> None:
        await client.call("volumes", "getVolume", id=target)

    async def list_all() -> None:
        await client.call("volumes", "listVolumes")

    gets = await timed(get, 2000 if total <= 1000 else 1000, warmup=50)
    n_lists = {10: 1000, 1000: 200}.get(total, 30)
    lists = await timed(list_all, n_lists, warmup=min(50, n_lists))
    client.close()
    return gets, lists


def ms(value: float) -> str:
    return f"{value * 1e3:.3f} ms"


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        echo_path = tmpdir / "echo.sock"
        # the two servers start before any clock runs: their Popen blocks nothing that is timed
        # _owner ends both (their process groups) also when the run fails or is killed
        echo = OWNER.popen([sys.executable, "-c", ECHO_SERVER, str(echo_path)],
                           stdout=subprocess.PIPE)
        feosd = OWNER.popen(
            [str(Path(sys.executable).parent / "feosd"), "--state-dir", str(tmpdir / "state"),
             "--run-dir", str(tmpdir / "run"), "--log-level", "WARNING"])
        try:
            wait_for(echo_path, echo)
            wait_for(tmpdir / "run" / "api.sock", feosd)
            await asyncio.sleep(0.2)
            limit = await echo_round_trip(echo_path, 3000)
            limit_median = statistics.median(limit)
            print(f"raw capnp echo over a Unix socket: median {ms(limit_median)}, "
                  f"p99 {ms(percentile(limit, 0.99))}")
            have = 0
            results = {}
            for total in (10, 1000, 10000):
                gets, lists = await feosd_round_trips(tmpdir / "run" / "api.sock", total, have)
                have = total
                results[total] = (statistics.median(gets), statistics.median(lists))
                print(f"{total:>6} volumes: GetVolume median {ms(statistics.median(gets))}, "
                      f"p99 {ms(percentile(gets, 0.99))}; ListVolumes median "
                      f"{ms(statistics.median(lists))}, p99 {ms(percentile(lists, 0.99))}")
        finally:
            feosd.terminate()
            echo.terminate()
            feosd.wait(30)
            echo.wait(30)
            OWNER.close()
    get_ratio = results[10000][0] / limit_median
    print(f"ratio GetVolume at 10000 volumes / raw capnp echo: {get_ratio:.2f} (target < 2)")
    print(f"ratio ListVolumes at 10000 volumes / 50 ms limit: {results[10000][1] / 0.050:.2f} "
          "(target < 1)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(_owner.main(lambda: asyncio.run(capnp.run(main()))))
