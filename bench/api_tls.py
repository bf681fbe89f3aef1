"""The cost of TLS on the API's TCP: the same calls to feosd over plain loopback TCP and over TLS.

Two feosd processes in temporary directories, one with `--tcp 127.0.0.1:P` (plain, loopback),
one with `--tcp 127.0.0.1:Q --tcp-client-ca` and a certificate of trustme's (ECDSA P-256, TLS 1.3,
a client certificate verified at every handshake). The client is pycapnp on asyncio, as feosctl
is, in this process: GetVolume on an open connection (what a script with one connection pays per
call), and a connection, one HostService.GetHostInfo and its close (what each feosctl run pays, less
its start), and feosctl host info as a process, what an operator waits for. The two kinds run in
alternating blocks, so that the machine's noise falls on both.

A TLS connection costs its handshake (TLS 1.3 with ECDSA on both sides, the client's certificate
verified) and, in feosctl, the client's context, which OpenSSL 3.0 takes about 10 ms to build
with its certificate and CA file loaded; once open, a call pays the encryption and asyncio's TLS
layer, which is Python on both sides (about 0.15 ms a round trip here, on calls of 0.35 ms: the
target of 1.6 for a call allows it). A connection builds its context (one per connection, as it
records the connection's SSL object): with the handshake some 13 ms beside a plain connection's
4 ms, hence a target of 5. The operator's figure is feosctl's whole run, below 1.3.
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
import trustme

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "integration"))

import _owner  # noqa: E402
from _owner import OWNER  # noqa: E402
from _timing import timed  # noqa: E402

from feos.rpc import Client, ClientTls  # noqa: E402

BLOCKS = 10


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_feosd(root: Path, *args: str) -> subprocess.Popen[bytes]:
    return OWNER.popen([str(Path(sys.executable).parent / "feosd"), "--state-dir",
                        str(root / "state"), "--run-dir", str(root / "run"),
                        "--log-level", "WARNING", *args])


async def wait_serving(port: int, tls: ClientTls | None, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            client = await Client.connect_tcp("127.0.0.1", port, tls)
            await client.call("host", "getHostInfo")
            client.close()
            return
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"feosd on {port} did not serve") from None
            await asyncio.sleep(0.1)


def feosctl_runs(kinds: dict[str, list[str]], count: int = 12) -> dict[str, list[float]]:
    """`feosctl --socket ... host info` as a process, each kind in turn, `count` times."""
    feosctl = [str(Path(sys.executable).parent / "feosctl"), "--socket"]
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(count):
        for kind, argv in kinds.items():
            start = time.perf_counter()
            subprocess.run([*feosctl, *argv, "host", "info"], check=True,
                           stdout=subprocess.DEVNULL)
            runs[kind].append(time.perf_counter() - start)
    return runs


def ms(value: float) -> str:
    return f"{value * 1e3:.3f} ms"


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(root / "ca.pem")
        server = ca.issue_cert("127.0.0.1")
        server.cert_chain_pems[0].write_to_path(root / "server.pem")
        server.private_key_pem.write_to_path(root / "server.key")
        ca.issue_cert("bench@example.com").private_key_and_cert_chain_pem.write_to_path(
            root / "client.pem")
        tls = ClientTls(root / "client.pem", ca=root / "ca.pem")
        plain_port, tls_port = free_port(), free_port()
        plain = start_feosd(root / "plain", "--tcp", f"127.0.0.1:{plain_port}")
        secure = start_feosd(root / "tls", "--tcp", f"127.0.0.1:{tls_port}", "--tcp-client-ca",
                             str(root / "ca.pem"), "--tcp-cert", str(root / "server.pem"),
                             "--tcp-key", str(root / "server.key"))
        try:
            await wait_serving(plain_port, None, plain)
            await wait_serving(tls_port, tls, secure)
            kinds = {"plain": (plain_port, None), "TLS": (tls_port, tls)}
            clients = {k: await Client.connect_tcp("127.0.0.1", p, t) for k, (p, t) in kinds.items()}
            target = str(uuid.uuid4())
            for client in clients.values():
                await client.call("volumes", "createVolume", id=target, sizeBytes=64 << 20)
            calls: dict[str, list[float]] = {k: [] for k in kinds}
            connects: dict[str, list[float]] = {k: [] for k in kinds}
            for block in range(BLOCKS + 1):  # the first block warms up, unkept
                for kind, (port, ctx) in kinds.items():
                    client = clients[kind]

                    async def get(client: Client = client) -> None:
                        await client.call("volumes", "getVolume", id=target)

                    async def connect_and_call(port: int = port,
                                               ctx: ClientTls | None = ctx) -> None:
                        one = await Client.connect_tcp("127.0.0.1", port, ctx)
                        await one.call("host", "getHostInfo")
                        one.close()

                    got, made = await timed(get, 300), await timed(connect_and_call, 20)
                    if block:
                        calls[kind] += got
                        connects[kind] += made
            for client in clients.values():
                client.close()
            flags = ["--tls-cert", str(root / "client.pem"), "--tls-ca", str(root / "ca.pem")]
            runs = await asyncio.to_thread(feosctl_runs, {"plain": [f"127.0.0.1:{plain_port}"],
                                                          "TLS": [f"127.0.0.1:{tls_port}", *flags]})
        finally:
            for proc in (plain, secure):
                proc.terminate()
            for proc in (plain, secure):
                proc.wait(30)
            OWNER.close()
    median = {k: (statistics.median(calls[k]), statistics.median(connects[k])) for k in kinds}
    for kind, (call, connect) in median.items():
        print(f"{kind:>5}: GetVolume on an open connection median {ms(call)}; "
              f"connect, GetHostInfo and close median {ms(connect)}")
    run = {k: statistics.median(v[2:]) for k, v in runs.items()}
    print(f"feosctl host info, the whole process: plain median {ms(run['plain'])}, "
          f"TLS median {ms(run['TLS'])}")
    print(f"the handshake's cost per connection: {ms(median['TLS'][1] - median['plain'][1])}")
    print(f"ratio GetVolume over TLS / over plain TCP: {median['TLS'][0] / median['plain'][0]:.2f} "
          "(target < 1.6)")
    print(f"ratio connect and one call over TLS / over plain TCP: "
          f"{median['TLS'][1] / median['plain'][1]:.2f} (target < 5)")
    print(f"ratio feosctl host info over TLS / over plain TCP: {run['TLS'] / run['plain']:.2f} "
          "(target < 1.3)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(_owner.main(lambda: asyncio.run(capnp.run(main()))))
