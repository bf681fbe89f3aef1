"""The node of bench/fleet.py: feosd's own pieces, both ways in, in one process of its own.

feosd's Daemon (its real services and bootstrap) serves the API on a Unix socket through the
Cap'n Proto thread, as feosd does, and NodeConnections dial the bench's control plane from a trio
run of their own on another thread, as the link does. A real feosd cannot be started with node
connections until the daemon wires the link (--control-plane: the join, the identity, the SPIFFE
check); this process is that wiring's node-connection half, with the bench's certificates.

argv: <tmpdir> <control plane's port> <server name> <ca.pem> <node.pem (key and chain)>
"""

from __future__ import annotations

import ssl
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fleet_push import LinkThread  # noqa: E402

from feos.daemon import Daemon, bind_unix, parse_args  # noqa: E402
from feos.fleet._calls import Dispatcher  # noqa: E402
from feos.fleet._nodeconn import NodeConnections, Target  # noqa: E402
from feos.rpc import capnp_thread, close_listeners, listen  # noqa: E402


async def main(tmp: Path, port: int, server_name: str, ca: str, node: str) -> None:
    daemon = Daemon(parse_args(["--state-dir", str(tmp / "state"), "--run-dir", str(tmp / "run"),
                                "--log-level", "WARNING"]))
    (tmp / "state").mkdir(parents=True, exist_ok=True)
    daemon.load()
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(node)
    ctx.set_alpn_protocols(["feos-node/1"])
    async with capnp_thread() as bridge:
        server = await bridge.call(listen, bind_unix(tmp / "run" / "api.sock"),
                                   daemon.bootstrap(bridge))
        services = {"volumes": daemon.volumes, "securityGroups": daemon.groups,
                    "names": daemon.names, "host": daemon.host, "mesh": object()}
        calls = Dispatcher(services, trio.lowlevel.current_trio_token(), bridge=bridge)
        async with LinkThread(NodeConnections(calls)) as link:
            await link.on_link_sync(link.conns.set_ssl_context, ctx)
            await link.on_link_sync(link.conns.set_targets,
                                    [Target("127.0.0.1", port, server_name)])
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the bench closes our stdin
        await bridge.call(close_listeners, [server])
    daemon.close()


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
