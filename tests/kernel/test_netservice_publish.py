"""Published ports through the whole network service (test_netservice_node's world: a node
namespace, a namespace standing for the pod behind a veth that `prepare` completes as a TAP,
and a "server" namespace beyond the uplink, here the client): prepare sets route_localnet and
loads the DNAT, the relay answers ::1 once the pods are loaded, check_spec refuses a second pod
on the port, a restarted service puts it all back, and remove takes it away."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import test_netservice_node as base
import trio
from test_netservice_node import World, pod, veth_pod

from feos.errors import Code, FeosError
from feos.net import PublishedPort

world, stores = base.world, base.stores  # the fixtures, as test_netservice_node has them
NODE4, NODE6, CLIENT6 = "10.99.0.1", "2001:db8:99::1", "2001:db8:99::2"
PREFIX = "2001:db8:7::/64"
WEB = PublishedPort("tcp", "", 8080, 80)
ANSWER = textwrap.dedent("""
    import http.server, socket, sys
    class S(http.server.HTTPServer):
        address_family = socket.AF_INET6
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"from the pod"
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            pass
    s = S(("::", 80), H, bind_and_activate=False)
    s.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.server_bind(); s.server_activate()
    print("ready", flush=True)
    s.serve_forever()
""")


def curl(ns: Any, host: str, port: int = 8080) -> str:
    url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    done = ns.run("curl", "-sS", "-m", "3", "-g", url, check=False)
    return done.stdout or f"error: {done.stderr.strip()}"


def uplink6(w: World) -> None:
    w.node.run("ip", "addr", "add", f"{NODE6}/64", "dev", "up0", "nodad")
    w.server.run("ip", "addr", "add", f"{CLIENT6}/64", "dev", "up1", "nodad")
    w.server.run("ip", "-6", "route", "add", PREFIX, "via", NODE6)


async def test_a_publish_through_the_service(world: World) -> None:
    w = world
    uplink6(w)
    net = await w.start()
    p = await net.allocate(pod("bcdefghjkmn", driver="firecracker", name_tables=(),
                               published=(WEB,)))
    net.check_spec(p)
    w.view.pods[p.id] = p
    veth_pod(w, p)
    await net.prepare(p)
    tap = f"pod-{p.id}"
    assert w.node.run("sysctl", "-n", f"net.ipv4.conf.{tap}.route_localnet").stdout.strip() == "1"
    w.pod.run("ip", "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0")
    server = w.pod.popen(sys.executable, "-c", ANSWER, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        got = {host: await trio.to_thread.run_sync(curl, w.server, host) for host in (NODE4, NODE6)}
        got |= {host: await trio.to_thread.run_sync(curl, w.node, host)
                for host in (NODE4, NODE6, "127.0.0.1")}
        assert got == dict.fromkeys(got, "from the pod"), got
        # the relay listens from the first write of the table in the service's nursery on
        assert await _relayed(net, w) == "from the pod"
        # another pod's create is refused, naming the holder
        other = pod("cdefghjkmnp", ipv6="2001:db8:7::9", ipv4="169.254.16.9", name_tables=(),
                    published=(PublishedPort("tcp", "::1", 8080, 80),))
        try:
            net.check_spec(other)
        except FeosError as e:
            assert e.code == Code.ALREADY_EXISTS and f"pod {p.id} publishes 8080:80/tcp" in e.message
        else:
            raise AssertionError("a held port was not refused")
        await net.remove(p)
        del w.view.pods[p.id]
        assert (await trio.to_thread.run_sync(curl, w.server, NODE4)).startswith("error")
        assert net.relays.ports() == []
    finally:
        server.kill()
        server.communicate()


async def _relayed(net: Any, w: World) -> str:
    """curl [::1]:8080 on the node after a write of the table (which opens the relays)."""
    await net._write_table(full=False, raise_errors=True)  # what the table loop does next
    assert net.relays.ports() == [8080]
    return await trio.to_thread.run_sync(curl, w.node, "::1")
