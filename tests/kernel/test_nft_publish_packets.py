"""Published ports with real packets: the compiled table in a throwaway node (test_nft_packets'
World: a node namespace with an uplink to an "internet" namespace, each pod a namespace behind
a veth named as its TAP would be), pods serving HTTP, clients in the internet namespace and on
the node itself, over IPv4 and IPv6. Never the machine's own addresses."""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import attrs
import pytest
import trio
from test_nft_packets import _SOCKETS as SOCKETS
from test_nft_packets import (
    FACTS,
    GROUPS,
    INET4,
    NODE4,
    NODE6,
    World,
    connects,
    in_netns,
    listen,
    sock,
)

from conftest import Netns
from feos.errors import Code, FeosError
from feos.net._contract import PublishedPort
from feos.net._nft import PodNet, compile_table
from feos.net._options import parse_network_options
from feos.net._ports import holder_of_port, open_proc_net, read_listeners
from feos.net._relay import Relays
from feos.net._service import _route_localnet
from feos.net._table import NftLoader, TableWriter

WEB = PublishedPort("tcp", "", 8080, 80)
ULA_SOURCE = "fd12:3456::1"  # the pods' prefix is a ULA: other IPv6 sources come from its ::1


class _Server(http.server.HTTPServer):
    address_family = socket.AF_INET6


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"pod saw {self.client_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


_SERVERS: list[http.server.HTTPServer] = []


def serve_http(ns: Netns, port: int = 80) -> None:
    """An HTTP server in the pod's namespace on [::]:port (IPv4 too), answering who it saw."""
    server = in_netns(ns.name, lambda: _Server(("::", port), _Answer, bind_and_activate=False))
    server.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.server_bind()
    server.server_activate()
    _SERVERS.append(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def get(ns: Netns, host: str, port: int, timeout: float = 3.0) -> str:
    """GET / from ns; the body, or the error's text."""
    def fetch() -> str:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/")
            return conn.getresponse().read().decode()
        except OSError as e:
            return f"error: {e}"
        finally:
            conn.close()

    return in_netns(ns.name, fetch)


def seen(answer: str) -> str:
    """The client address the pod saw, without an IPv4-mapped prefix."""
    assert answer.startswith("pod saw "), answer
    return answer.removeprefix("pod saw ").removeprefix("::ffff:")


@pytest.fixture
async def world(make_netns: Callable[[str], Netns]) -> AsyncIterator[tuple[World, TableWriter]]:
    world = World(make_netns)
    loader = NftLoader(world.node.name)
    try:
        yield world, TableWriter(loader)
    finally:
        loader.close()
        while _SERVERS:
            s = _SERVERS.pop()
            s.shutdown()
            s.server_close()
        while SOCKETS:
            SOCKETS.pop().close()


def publish(world: World, pod: PodNet, *ports: PublishedPort) -> PodNet:
    published = attrs.evolve(pod, published=ports)
    ns = world.pods[pod.tap][0]
    world.pods[pod.tap] = (ns, published)
    # as feosd's guests of a ULA prefix: IPv6 routes back only to fc00::/7
    ns.run("ip", "-6", "route", "del", "default")
    ns.run("ip", "-6", "route", "add", "fc00::/7", "via", "fe80::1", "dev", "eth0")
    if any(p.host_address in ("", "0.0.0.0", "127.0.0.1") for p in ports):
        in_netns(world.node.name, lambda: _route_localnet(None, pod.tap))  # as prepare() does
    return published


async def load(world: World, writer: TableWriter) -> str:
    return await writer.write(compile_table(world.pod_nets(), GROUPS, FACTS))


async def test_a_published_port_from_outside_over_both_families(
    world: tuple[World, TableWriter],
) -> None:
    w, writer = world
    pod = publish(w, w.add_pod(1), WEB)
    serve_http(w.ns(pod))
    await load(w, writer)
    # the pod sees the client's own IPv4 address; IPv6 from the prefix's ::1 (a ULA prefix)
    assert seen(get(w.inet, NODE4, 8080)) == INET4
    assert seen(get(w.inet, NODE6, 8080)) == ULA_SOURCE
    # a port not published is not forwarded; nor is the pod reached without the DNAT
    assert not connects(w.inet, NODE4, 8081)
    assert not connects(w.inet, NODE6, 80)
    assert not connects(w.inet, str(pod.ipv6), 80)  # its in- chain takes only what DNAT made


async def test_an_address_limits_the_publish(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    pod = publish(w, w.add_pod(1), PublishedPort("tcp", NODE6, 8080, 80),
                  PublishedPort("tcp", NODE4, 9090, 80))
    serve_http(w.ns(pod))
    await load(w, writer)
    assert seen(get(w.inet, NODE6, 8080)) == ULA_SOURCE
    assert not connects(w.inet, NODE4, 8080)
    assert seen(get(w.inet, NODE4, 9090)) == INET4
    assert not connects(w.inet, NODE6, 9090)


async def test_from_the_node_itself_its_addresses_and_loopback(
    world: tuple[World, TableWriter],
) -> None:
    w, writer = world
    pod = publish(w, w.add_pod(1), WEB)
    serve_http(w.ns(pod))
    await load(w, writer)
    assert seen(get(w.node, NODE4, 8080)) == NODE4
    assert seen(get(w.node, NODE6, 8080)) == ULA_SOURCE
    # 127.0.0.1: DNAT, out by the TAP (route_localnet), masqueraded to the TAP's own address
    via_lo = seen(get(w.node, "127.0.0.1", 8080))
    assert via_lo != "127.0.0.1" and via_lo.startswith("169.254.")
    # ::1: the table leaves it to feosd's relay (nothing listens here: refused, not DNATed)
    assert get(w.node, "::1", 8080).startswith("error")
    async with trio.open_nursery() as nursery:
        relays = Relays(w.node.name)
        await nursery.start(relays.run)
        await relays.sync({8080: (str(pod.ipv6), 80)})
        answer = await trio.to_thread.run_sync(get, w.node, "::1", 8080)
        assert seen(answer) == ULA_SOURCE  # the relay's own connection, from the node
        await relays.sync({})
        assert (await trio.to_thread.run_sync(get, w.node, "::1", 8080)).startswith("error")
        nursery.cancel_scope.cancel()


async def test_udp_over_both_families(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    pod = publish(w, w.add_pod(1), PublishedPort("udp", "", 5353, 53))
    await load(w, writer)
    echo = sock(w.ns(pod), socket.AF_INET6, socket.SOCK_DGRAM)
    echo.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    echo.bind(("::", 53))
    echo.settimeout(3.0)
    for node, client_address in ((NODE4, INET4), (NODE6, ULA_SOURCE)):
        family = socket.AF_INET6 if ":" in node else socket.AF_INET
        client = sock(w.inet, family, socket.SOCK_DGRAM)
        client.settimeout(3.0)
        client.sendto(b"ping", (node, 5353))
        data, peer = echo.recvfrom(64)
        assert (data, peer[0].removeprefix("::ffff:")) == (b"ping", client_address)
        echo.sendto(b"pong", peer)
        assert client.recvfrom(64) == (b"pong", (node, 5353, 0, 0)[: 2 if family == 2 else 4])


async def test_a_pod_gone_takes_its_publish_back(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    a = publish(w, w.add_pod(1), WEB)
    b = w.add_pod(2)
    serve_http(w.ns(a))
    await load(w, writer)
    assert seen(get(w.inet, NODE4, 8080)) == INET4
    del w.pods[a.tap]
    assert await load(w, writer) == "chains"
    assert not connects(w.inet, NODE4, 8080)
    assert not connects(w.inet, NODE6, 8080)
    # the port is another pod's now, at once
    publish(w, b, WEB)
    serve_http(w.ns(b))
    assert await load(w, writer) == "chains"
    assert seen(get(w.inet, NODE6, 8080)) == ULA_SOURCE


@pytest.fixture
def proc_net(netns: Netns) -> Iterator[dict[str, int]]:
    fds = in_netns(netns.name, open_proc_net)
    yield fds
    for fd in fds.values():
        os.close(fd)


def test_a_port_the_namespace_listens_on_is_held(netns: Netns, proc_net: dict[str, int]) -> None:
    server = listen(netns, "127.0.0.1", 8080)
    udp = sock(netns, socket.AF_INET6, socket.SOCK_DGRAM)
    udp.bind(("::", 5353))
    try:
        listeners = read_listeners(proc_net)
        assert holder_of_port(WEB, listeners, set()) == "the node listens on 127.0.0.1:8080/tcp"
        assert holder_of_port(PublishedPort("tcp", "::1", 8080, 80), listeners, set()) is None
        assert holder_of_port(PublishedPort("udp", "0.0.0.0", 5353, 53), listeners, set()) == (
            "the node listens on [::]:5353/udp")
        # the test's own namespace is not the one read
        assert holder_of_port(PublishedPort("tcp", "", 8081, 80), listeners, set()) is None
    finally:
        server.close()
        udp.close()


async def test_check_spec_refuses_a_held_port(netns: Netns, tmp_path: object) -> None:
    """The network service's check at create, against a real listener of its namespace."""
    from pathlib import Path

    from feos.net import PodNet as ContractPod
    from feos.net._service import Network

    class View:
        def network_pods(self) -> list[ContractPod]:
            return []

    class Store:
        def get(self, key: str) -> None:
            return None

        def items(self) -> list[tuple[str, object]]:
            return []

        def __contains__(self, key: object) -> bool:
            return False

    net = Network(parse_network_options(pod_prefix="2001:db8:1::/64"), Path(str(tmp_path)),
                  View(), Store(), Store(), netns=netns.name)
    net._reason = None  # as once run() set it up
    net._proc_net = in_netns(netns.name, open_proc_net)
    # feosd's own listener (the test's process stands in for feosd) and another process's
    own = listen(netns, "::", 7443)
    other = netns.popen(sys.executable, "-c", _LISTENER, stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE)
    try:
        assert other.stdout is not None and other.stdout.readline() == b"up\n"
        for port, holder in ((7443, "feosd itself listens on [::]:7443/tcp (its API)"),
                             (7444, "the node listens on [::]:7444/tcp")):
            pod = ContractPod("abcdefghjkm", "2001:db8:1::2", "169.254.16.2", (), (), (), "",
                              "qemu", published=(PublishedPort("tcp", "", port, 443),))
            with pytest.raises(FeosError) as e:
                net.check_spec(pod)
            assert e.value.code == Code.ALREADY_EXISTS
            assert e.value.message == f"spec.network.publish[0]: {port}:443/tcp: {holder}"
    finally:
        own.close()
        other.kill()
        other.communicate()  # reaps it and closes its pipes
        for fd in net._proc_net.values():
            os.close(fd)


_LISTENER = """
import socket, sys
s = socket.socket(socket.AF_INET6)
s.bind(("::", 7444))
s.listen()
print("up", flush=True)
sys.stdin.read()
"""
