"""`feosctl traffic watch`: its lines, and the command as a process against a served
TrafficService (the Feos root on a Unix socket, as feosd serves it)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from feos import _schema
from feos.cli._traffic import record_line
from feos.net._traffic import DnsQuery, Flow, RecordHub
from feos.net._traffic_service import TrafficService, record_dict
from feos.rpc import capnp_thread
from feos.rpc._server import Cap, listen, serve

A = "abcdefghjkm"
T = 1_764_576_000_000_000_000  # 2025-12-01T08:00:00Z


def test_lines() -> None:
    flow = {"timeUnixNs": T, "missed": 0, "flow": {
        "podId": A, "protocol": 6, "source": "169.254.16.2:40000",
        "destination": "[2001:db8::1]:443", "packetsOut": 3, "bytesOut": 180, "packetsIn": 2,
        "bytesIn": 120, "startUnixNs": T - 1_500_000_000, "endUnixNs": T}}
    assert record_line(flow) == (
        f"2025-12-01T08:00:00.000Z {A} flow tcp 169.254.16.2:40000 -> [2001:db8::1]:443 "
        "out 3p/180B in 2p/120B 1.5s")
    drop = {"timeUnixNs": T + 5_000_000, "missed": 4, "drop": {
        "podId": A, "reason": "deny", "protocol": 17, "source": "169.254.16.2:5353",
        "destination": "10.0.0.1:53"}}
    assert record_line(drop) == (
        f"2025-12-01T08:00:00.005Z {A} drop deny udp 169.254.16.2:5353 -> 10.0.0.1:53 "
        "(missed 4 before)")
    sni = {"timeUnixNs": T, "serverName": {"podId": A, "name": "example.com", "kind": "tls",
                                           "destination": "192.0.2.1:443"}}
    assert record_line(sni).endswith(f"{A} tls example.com -> 192.0.2.1:443")
    dns = {"timeUnixNs": T, "dnsQuery": {"podId": "", "name": "web.", "type": 28, "rcode": 5,
                                         "answers": [], "upstream": ""}}
    assert record_line(dns).endswith("- dns web. AAAA REFUSED - via name tables")
    assert "does not know" in record_line({"timeUnixNs": T})


WATCH = "from feos.cli._main import main\nmain()\n"


async def test_feosctl_traffic_watch_as_a_process(tmp_path: Path) -> None:
    net, api = _schema.network(), _schema.api()
    hub = RecordHub()
    watching = trio.Event()

    class Watched(TrafficService):
        def open_stream(self, pod_id: str = "") -> Any:
            stream = super().open_stream(pod_id)
            watching.set()
            return stream

    svc = Watched(hub)

    class Root:
        async def traffic(self, params: dict[str, Any]) -> dict[str, Any]:
            return {"service": Cap(net.TrafficService, svc)}

    path = tmp_path / "api.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    async with capnp_thread() as bridge:
        server = await bridge.call(listen, listener, lambda: serve(api.Feos, Root(), bridge))
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", WATCH, "--socket", str(path), "traffic", "watch", A],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with trio.fail_after(20):
                await watching.wait()
                hub.publish(Flow("bcdefghjkmn", 6, "169.254.16.3", 1, "10.0.0.1", 80, 1, 1, 1, 1,
                                 1.0, 2.0))
                hub.publish(DnsQuery(A, "web.", "A", "NOERROR", ("10.0.0.1",), 3.0))
                assert proc.stdout is not None
                out = b""
                while not out.endswith(b"\n"):
                    out += await proc.stdout.receive_some(4096)
                line = out.decode()
                for sub in list(hub._subs):
                    sub.send.close()  # the node's network stops: the stream ends
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

        async def close() -> None:
            server.close()

        await bridge.call(close)
    listener.close()
    assert line == f"1970-01-01T00:00:03.000Z {A} dns web. TYPE0 NOERROR 10.0.0.1 via name tables\n"
    assert record_dict(DnsQuery(A, "web.", "A", "NOERROR", (), 3.0))["dnsQuery"]["type"] == 0
