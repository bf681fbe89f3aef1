"""Traffic records from real traffic between namespaces: a pod's namespace, the node's (which
forwards, tracks connections and logs to nflog as the table does) and a server's.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from feos.net._links import TapSpec, make_tap, prepare_node
from feos.net._options import parse_network_options
from feos.net._traffic import (
    Drop,
    Flow,
    PodDirectory,
    RecordHub,
    ServerName,
    TrafficCollector,
    delete_conntrack,
    enable_accounting,
)

OPTIONS = parse_network_options(pod_prefix="2001:db8:1::/64")
POD4, POD6 = ipaddress.IPv4Address("169.254.16.1"), ipaddress.IPv6Address("2001:db8:1::2")
TAP = "pod-abcdefghjkm"
SERVER = "10.99.0.2"

TABLE = f"""
table inet feostest {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname "pod-*" meta l4proto tcp ct direction original ct original packets < 5 log group 3
    iifname "pod-*" tcp dport 9 log group 2 prefix "feos:deny:{TAP}" drop
    iifname "pod-*" tcp dport 10 log group 2 prefix "feos:no-rule" drop
    ct state established,related accept
  }}
}}
"""

SERVE = textwrap.dedent("""
    import socket, threading
    def serve(port, answer):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("10.99.0.2", port)); s.listen()
        while True:
            c, _ = s.accept(); c.settimeout(2)
            try:
                c.recv(65536)
                c.sendall(answer)
            except OSError:
                pass
            c.close()
    threading.Thread(target=serve, args=(8443, b""), daemon=True).start()
    print("ready", flush=True)
    serve(8080, b"HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
""")

TLS_CLIENT = textwrap.dedent("""
    import socket, ssl
    ctx = ssl.create_default_context()
    s = socket.create_connection(("10.99.0.2", 8443), timeout=3)
    try:
        ctx.wrap_socket(s, server_hostname="sni.example.test")
    except (OSError, ssl.SSLError):
        pass
""")


@attrs.define
class World:
    node: Any
    pod: Any
    hub: RecordHub
    pods: PodDirectory


@pytest.fixture
async def world(make_netns: Any) -> AsyncIterator[World]:
    node, pod, server = make_netns("node"), make_netns("pod"), make_netns("srv")
    node.run("ip", "link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns",
             server.name)
    node.run("ip", "addr", "add", "10.99.0.1/24", "dev", "up0")
    node.run("ip", "link", "set", "up0", "up")
    node.run("ip", "route", "add", "default", "via", SERVER)  # the proxy ARP needs one
    server.run("ip", "addr", "add", f"{SERVER}/24", "dev", "up1")
    server.run("ip", "link", "set", "up1", "up")
    server.run("ip", "route", "add", "default", "via", "10.99.0.1")
    node.run("ip", "link", "add", TAP, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    pod.run("ip", "addr", "add", f"{POD4}/32", "dev", "eth0")
    pod.run("ip", "link", "set", "eth0", "up")
    pod.run("ip", "route", "add", "169.254.0.1", "dev", "eth0")
    pod.run("ip", "route", "add", "default", "via", "169.254.0.1", "dev", "eth0")
    await prepare_node(OPTIONS, node.name)
    ifindex = await make_tap(TapSpec(TAP, POD6, POD4, OPTIONS.dns_address, OPTIONS.otlp_address,
                                     metadata=False), node.name)
    node.run("nft", "-f", "-", input=TABLE)
    await trio.to_thread.run_sync(enable_accounting, node.name)
    assert node.run("sysctl", "-n", "net.netfilter.nf_conntrack_acct").stdout.strip() == "1"
    assert node.run("sysctl", "-n", "net.netfilter.nf_conntrack_timestamp").stdout.strip() == "1"
    srv = server.popen(sys.executable, "-c", SERVE, stdout=subprocess.PIPE)
    try:
        assert srv.stdout is not None
        assert srv.stdout.readline() == b"ready\n"
        hub, pods = RecordHub(), PodDirectory()
        pods.add("abcdefghjkm", [POD4, POD6], TAP, ifindex)
        pods.resolver.add(OPTIONS.dns_address)
        async with trio.open_nursery() as nursery:
            await nursery.start(TrafficCollector(hub, pods, node.name).run)
            yield World(node, pod, hub, pods)
            nursery.cancel_scope.cancel()
    finally:
        srv.kill()
        srv.wait()
        if srv.stdout is not None:
            srv.stdout.close()


async def _in_pod(w: World, *argv: str) -> int:
    done = await trio.run_process(["ip", "netns", "exec", w.pod.name, *argv], check=False,
                                  capture_stdout=True, capture_stderr=True)
    return done.returncode


async def _collect(rx: Any, want: Any, wait: float = 5.0) -> list[Any]:
    got: list[Any] = []
    with trio.move_on_after(wait):
        async for rec in rx:
            got.append(rec)
            if want(got):
                break
    return got


async def test_flows_names_drops_and_deletion(world: World) -> None:
    w = world
    began = time.time()
    with w.hub.subscribe() as rx:
        assert await _in_pod(w, "curl", "-sS", "-m", "3", "-H", "Host: web.example.test",
                             f"http://{SERVER}:8080/") == 0
        await _in_pod(w, sys.executable, "-c", TLS_CLIENT)
        assert await _in_pod(w, "curl", "-sS", "-m", "1", f"http://{SERVER}:9/") != 0
        assert await _in_pod(w, "curl", "-sS", "-m", "1", f"http://{SERVER}:10/") != 0

        def names_and_drop(got: list[Any]) -> bool:
            kinds = {(type(r).__name__, getattr(r, "kind", None)) for r in got}
            reasons = {r.reason for r in got if isinstance(r, Drop)}
            return {("ServerName", "http"), ("ServerName", "tls")} <= kinds and {
                "deny", "no-rule"} <= reasons

        got = await _collect(rx, names_and_drop)
        names = {(r.kind, r.name, r.dport) for r in got if isinstance(r, ServerName)}
        assert ("http", "web.example.test", 8080) in names
        assert ("tls", "sni.example.test", 8443) in names
        drops = {(r.pod_id, r.reason, r.dst, r.dport) for r in got if isinstance(r, Drop)}
        assert ("abcdefghjkm", "deny", SERVER, 9) in drops  # the TAP from the prefix
        assert ("abcdefghjkm", "no-rule", SERVER, 10) in drops  # the TAP from the input device
        assert all(r.pod_id == "abcdefghjkm" for r in got)

        # Deleting the pod's connections ends them: their destroy events become its flows.
        listed = w.node.run("conntrack", "-L", "-s", str(POD4)).stdout
        assert "dport=8080" in listed
        gone = await delete_conntrack([POD4, POD6], w.node.name)
        assert gone >= 2
        flows = [r for r in await _collect(rx, lambda g: sum(
            isinstance(r, Flow) for r in g) >= gone) if isinstance(r, Flow)]
    http = [f for f in flows if f.dport == 8080]
    assert len(http) == 1
    f = http[0]
    assert (f.pod_id, f.protocol, f.src, f.dst) == ("abcdefghjkm", 6, str(POD4), SERVER)
    assert f.packets_out >= 3
    assert f.bytes_out > 100  # the request
    assert f.bytes_in > 40  # the answer
    assert began - 5 <= f.start <= f.end <= time.time() + 1
    assert "src=169.254.16.1" not in w.node.run("conntrack", "-L").stdout
    assert w.node.run("conntrack", "-L", "-s", str(POD4), check=False).stdout.strip() == ""

