"""Pushed calls over a node connection beside the same calls over feosd's Unix socket.

One run, TLS on, both clients in this process: the control plane's HTTP/2 client of
tests/fleet_push.py (trio; over libnghttp2, tests/fleet_ngclient.py, or h2's with
FEOS_BENCH_PUSH_HTTP2=h2) on the connection the node dialed to this process's TLS listener
(trustme's certificates, TLS 1.3, ALPN feos-node/1), and the pycapnp client feosctl uses
(feos.rpc.Client, asyncio on a thread of its own) on the node's api.sock. The node is one
process of its own (bench/_fleet_node.py): feosd's Daemon with its real services and bootstrap
serving the socket through the Cap'n Proto thread, and NodeConnections on a trio run of their own
on another thread serving the same services, as the link does. A real feosd process cannot dial
a control plane with node connections until the daemon wires the link (the join and the
identity); that process is feosd's pieces in the same threads, so the two ways in are compared on
equal terms, each across a process boundary.

Measured in alternating rounds: the round trip of one GetVolume at a time, and 1,000 concurrent
GetVolumes' throughput, on each way in. Both clients read the answer's volume id.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import capnp
import trio
import trustme

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "integration"))
sys.path.insert(0, str(ROOT / "tests"))

import _owner  # noqa: E402
from _owner import OWNER  # noqa: E402
from fleet_push import SERVER_NAME, PushClient, PushListener, params_body, results_module  # noqa: E402

from feos.errors import Code  # noqa: E402
from feos.rpc._client import Client  # noqa: E402

ROUNDS = 5
SINGLE = 400  # sequential calls per round
BURST = 1000  # concurrent calls per round


class CapnpSide:
    """feosctl's client on an asyncio loop (pycapnp's) on a thread of its own."""

    def __init__(self, socket_path: Path) -> None:
        self.path = socket_path
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: Client | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="capnp-client", daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.client = await Client.connect(str(self.path))
            self._ready.set()
            await self._stop.wait()
            self.client.close()

        asyncio.run(capnp.run(main()))

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(20):
            raise SystemExit("the pycapnp client did not connect")

    def run(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        assert self.loop is not None

        async def wrapped() -> Any:
            return await fn()

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result()

    def stop(self) -> None:
        assert self.loop is not None
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def socket_rounds(side: CapnpSide, volume: str) -> tuple[list[float], float]:
    async def get() -> None:
        assert side.client is not None
        results = await side.client.call("volumes", "getVolume", id=volume)
        assert results.volume.id == volume

    async def single() -> list[float]:
        samples = []
        for _ in range(SINGLE):
            start = time.perf_counter()
            await get()
            samples.append(time.perf_counter() - start)
        return samples

    async def burst() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(get() for _ in range(BURST)))
        return BURST / (time.perf_counter() - start)

    return side.run(single), side.run(burst)


async def node_rounds(client: PushClient, volume: str) -> tuple[list[float], float]:
    module = results_module("volumes", "getVolume")

    async def get() -> None:
        response = await client.raw("/volumes/getVolume",
                                    params_body("volumes", "getVolume", {"id": volume}))
        assert response.status[0] == Code.OK, response.status
        with module.from_bytes(bytes(response.body)) as results:
            assert results.volume.id == volume

    samples = []
    for _ in range(SINGLE):
        start = time.perf_counter()
        await get()
        samples.append(time.perf_counter() - start)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(BURST):
            nursery.start_soon(get)
    return samples, BURST / (time.perf_counter() - start)


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_pems(tmp: Path, ca: trustme.CA) -> tuple[Path, Path]:
    ca_pem, node_pem = tmp / "ca.pem", tmp / "node.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    ca.issue_cert("node.feos.test").private_key_and_cert_chain_pem.write_to_path(str(node_pem))
    return ca_pem, node_pem


async def bench(tmp: Path) -> tuple[float, float, float, float]:
    ca = trustme.CA()
    # the control plane's client over libnghttp2 (tests/fleet_ngclient.py): h2's alone cost more
    # per call than the target allows; FEOS_BENCH_PUSH_HTTP2=h2 measures with h2's
    listener = PushListener(ca, http2=os.environ.get("FEOS_BENCH_PUSH_HTTP2", "nghttp2"))
    ca_pem, node_pem = write_pems(tmp, ca)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.serve)
        node = OWNER.popen([sys.executable, str(HERE / "_fleet_node.py"), str(tmp),
                            str(listener.port), SERVER_NAME, str(ca_pem), str(node_pem)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert node.stdout is not None
            line = await trio.to_thread.run_sync(node.stdout.readline)
            if line.strip() != b"ready":
                raise SystemExit("the node did not start")
            with trio.fail_after(20):
                client = await listener.accept()
            side = CapnpSide(tmp / "run" / "api.sock")
            side.start()
            volume = str(uuid.uuid4())
            await client.call_ok("volumes", "createVolume", {"id": volume, "sizeBytes": 64 << 20})
            node_single: list[float] = []
            socket_single: list[float] = []
            node_rate: list[float] = []
            socket_rate: list[float] = []
            await node_rounds(client, volume)  # warm both ways in
            await trio.to_thread.run_sync(socket_rounds, side, volume)
            pushed = {"node": 0.0, "control plane": 0.0}
            direct = {"node": 0.0, "client": 0.0}
            for _ in range(ROUNDS):
                before = cpu_seconds(node.pid), cpu_seconds(os.getpid())
                samples, rate = await node_rounds(client, volume)
                after = cpu_seconds(node.pid), cpu_seconds(os.getpid())
                pushed["node"] += after[0] - before[0]
                pushed["control plane"] += after[1] - before[1]
                node_single += samples
                node_rate.append(rate)
                samples, rate = await trio.to_thread.run_sync(socket_rounds, side, volume)
                direct["node"] += cpu_seconds(node.pid) - after[0]
                direct["client"] += cpu_seconds(os.getpid()) - after[1]
                socket_single += samples
                socket_rate.append(rate)
            side.stop()
            await client.aclose()
            calls = ROUNDS * (SINGLE + BURST)
            for what, cpu in (("pushed call", pushed), ("socket call", direct)):
                print(f"CPU per {what}: " + ", ".join(
                    f"{who} {seconds / calls * 1e3:.3f} ms" for who, seconds in cpu.items()))
        finally:
            assert node.stdin is not None
            node.stdin.close()
            await trio.to_thread.run_sync(node.wait, 30)
            OWNER.close()
        nursery.cancel_scope.cancel()
    return (statistics.median(node_single), statistics.median(socket_single),
            statistics.median(node_rate), statistics.median(socket_rate))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        node_call, socket_call, node_rate, socket_rate = trio.run(bench, Path(tmp))
    print(f"GetVolume one at a time: node connection median {node_call * 1e3:.3f} ms, "
          f"socket median {socket_call * 1e3:.3f} ms")
    print(f"{BURST} concurrent GetVolumes: node connection {node_rate:.0f} calls/s, "
          f"socket {socket_rate:.0f} calls/s")
    print(f"ratio node connection call / socket call: {node_call / socket_call:.2f} "
          "(target < 1.5)")
    print(f"ratio node connection throughput / socket throughput: {node_rate / socket_rate:.2f} "
          "(target >= 0.7)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(_owner.main(main))
