"""The compiled table in a throwaway node, with real packets between namespaces.

The node's namespace holds the table; each pod is a namespace behind a veth pair whose node end
is named pod-<8 hex digits>, as the TAP would be, and set up as feosd sets a TAP up (the
resolver's address, fe80::1/64, routes for the pod's /128 and /32). The internet is a namespace
behind the node's uplink with a few hosts on its loopback.
"""

from __future__ import annotations

import ctypes
import ipaddress as ip
import json
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import attrs
import pytest

from conftest import Netns, run
from feos.errors import Code, FeosError
from feos.net._groups import GroupPeer, Ports, Protocol, Rule, SecurityGroup, parse_block
from feos.net._nft import NodeFacts, PodNet, compile_table
from feos.net._table import NftLoader, TableWriter, drop_counts, loaded_rules, loaded_sets

T = TypeVar("T")
_libc = ctypes.CDLL(None, use_errno=True)

PREFIX = ip.IPv6Network("fd12:3456::/64")
NODE4, INET4 = "192.0.2.1", "192.0.2.2"
NODE6, INET6 = "2001:db8:ffff::1", "2001:db8:ffff::2"
HOST4, DENIED4, METADATA = "198.51.100.10", "203.0.113.10", "169.254.169.254"
HOST6, DENIED6 = "2001:db8:cafe::10", "2001:db8:dead::10"
DNS = "169.254.0.53"

FACTS = NodeFacts(
    PREFIX,
    deny_prefixes=(ip.ip_network("203.0.113.0/24"), ip.ip_network("2001:db8:dead::/48")),
    node_addresses=(ip.ip_address(NODE4), ip.ip_address(NODE6)),
)


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """fn() on a thread of its own inside namespace ns (sockets made there stay there)."""
    box: list[T] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, 0x40000000) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            box.append(fn())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


_SOCKETS: list[socket.socket] = []  # closed by the world fixture, also when a test fails


def sock(ns: Netns, family: int, kind: int) -> socket.socket:
    made = in_netns(ns.name, lambda: socket.socket(family, kind))
    _SOCKETS.append(made)
    return made


def family_of(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def listen(ns: Netns, address: str, port: int, *, transparent: bool = False) -> socket.socket:
    server = sock(ns, family_of(address), socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if transparent:
        server.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT: the address is not the node's
    server.bind((address, port))
    server.listen(16)
    server.settimeout(2.0)
    return server


def connects(
    ns: Netns, address: str, port: int, *, timeout: float = 0.6, source: str | None = None
) -> bool:
    """Whether a TCP connection from ns to address:port completes within timeout."""
    client = sock(ns, family_of(address), socket.SOCK_STREAM)
    client.settimeout(timeout)
    try:
        if source is not None:
            client.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
            client.bind((source, 0))
        client.connect((address, port))
        return True
    except (TimeoutError, OSError):
        return False
    finally:
        client.close()


def peer_of(server: socket.socket) -> str:
    """The source address of the connection the server took."""
    conn, peer = server.accept()
    conn.close()
    return str(peer[0])


class World:
    def __init__(self, make_netns: Callable[[str], Netns]) -> None:
        self.make_netns = make_netns
        self.node = make_netns("node")
        self.inet = make_netns("inet")
        self.pods: dict[str, tuple[Netns, PodNet]] = {}
        self._uplink()

    def _uplink(self) -> None:
        node, inet = self.node, self.inet
        for key in ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"):
            node.run("sysctl", "-qw", key)
        for ns in (node, inet):  # link-locals usable at once: no DAD to wait for
            ns.run("sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0")
        run("ip", "link", "add", "up0", "netns", node.name, "type", "veth",
            "peer", "name", "eth0", "netns", inet.name)  # fmt: skip
        node.run("ip", "addr", "add", f"{NODE4}/24", "dev", "up0")
        node.run("ip", "addr", "add", f"{NODE6}/64", "dev", "up0", "nodad")
        inet.run("ip", "addr", "add", f"{INET4}/24", "dev", "eth0")
        inet.run("ip", "addr", "add", f"{INET6}/64", "dev", "eth0", "nodad")
        for host in (HOST4, DENIED4, METADATA):
            inet.run("ip", "addr", "add", f"{host}/32", "dev", "lo")
        for host in (HOST6, DENIED6):
            inet.run("ip", "addr", "add", f"{host}/128", "dev", "lo")
        node.run("ip", "link", "set", "up0", "up")
        inet.run("ip", "link", "set", "eth0", "up")
        node.run("ip", "route", "add", "default", "via", INET4)
        node.run("ip", "-6", "route", "add", "default", "via", INET6)
        # the pods' IPv6 is routed as it is; their IPv4 comes back only if masqueraded
        inet.run("ip", "-6", "route", "add", str(PREFIX), "via", NODE6)
        node.run("ip", "route", "add", "local", f"{METADATA}/32", "dev", "lo", "table", "169254")

    def add_pod(self, n: int, *groups: str, local_metadata: bool = False) -> PodNet:
        tap = f"pod-{n:08x}"
        pod = PodNet(
            tap, ip.IPv6Address(f"fd12:3456::{n + 1:x}"), ip.IPv4Address(f"169.254.16.{n + 1}"),
            groups, local_metadata,
        )  # fmt: skip
        ns = self.make_netns("pod")
        node = self.node
        # the pod's link-local is usable at once (no DAD to wait for), and it sends no RS
        for key in ("accept_dad=0", "router_solicitations=0"):
            ns.run("sysctl", "-qw", f"net.ipv6.conf.default.{key}")
        run("ip", "link", "add", tap, "netns", node.name, "type", "veth",
            "peer", "name", "eth0", "netns", ns.name)  # fmt: skip
        node.run("ip", "link", "set", "dev", tap, "addrgenmode", "none")  # no link-local of its own
        node.run("ip", "addr", "add", f"{DNS}/32", "dev", tap)
        node.run("ip", "addr", "add", "fe80::1/64", "dev", tap, "nodad")
        node.run("ip", "link", "set", tap, "up")
        node.run("ip", "route", "add", f"{pod.ipv6}/128", "dev", tap)
        node.run("ip", "route", "add", f"{pod.ipv4}/32", "dev", tap)
        mac = node.run("cat", f"/sys/class/net/{tap}/address").stdout.strip()
        ns.run("ip", "addr", "add", f"{pod.ipv6}/128", "dev", "eth0", "nodad")
        ns.run("ip", "addr", "add", f"{pod.ipv4}/32", "dev", "eth0")
        ns.run("ip", "link", "set", "eth0", "up")
        ns.run(
            "ip", "neigh", "add", "169.254.0.1", "lladdr", mac, "dev", "eth0", "nud", "permanent"
        )
        ns.run("ip", "route", "add", "default", "via", "169.254.0.1", "dev", "eth0", "onlink")
        ns.run("ip", "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0")
        if local_metadata:  # as feos.net._links does: 169.254.169.254 local for this TAP alone
            node.run("ip", "rule", "add", "iif", tap, "to", f"{METADATA}/32", "table", "169254")
        self.pods[tap] = (ns, pod)
        return pod

    def ns(self, pod: PodNet) -> Netns:
        return self.pods[pod.tap][0]

    def pod_nets(self) -> list[PodNet]:
        return [p for _, p in self.pods.values()]


# ---- the tests -----------------------------------------------------------------------------

CLIENT = SecurityGroup(
    "client", rules_out=(Rule(Protocol.TCP, GroupPeer("web"), Ports(8080, 8080)),)
)
WEB = SecurityGroup(
    "web",
    rules_in=(Rule(Protocol.TCP, GroupPeer("client"), Ports(8080, 8080)),),
    rules_out=(Rule(Protocol.UDP, parse_block("2001:db8:cafe::/48", []), Ports(53, 53)),),
)
GROUPS = {"client": CLIENT, "web": WEB}


@pytest.fixture
async def world(make_netns: Callable[[str], Netns]) -> AsyncIterator[tuple[World, TableWriter]]:
    world = World(make_netns)
    loader = NftLoader(world.node.name)
    try:
        yield world, TableWriter(loader)
    finally:
        loader.close()
        while _SOCKETS:
            _SOCKETS.pop().close()


async def load(world: World, writer: TableWriter, facts: NodeFacts = FACTS) -> list[Any]:
    await writer.write(compile_table(world.pod_nets(), GROUPS, facts))
    return await writer.loader.read()


async def drops(writer: TableWriter) -> dict[tuple[str, str, str | None], int]:
    return {k: v for k, v in drop_counts(await writer.loader.read()).items() if v}


async def test_groups_allow_and_deny_between_pods(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    a, b, c = w.add_pod(1, "client"), w.add_pod(2, "web"), w.add_pod(3)
    await load(w, writer)
    server = listen(w.ns(b), str(b.ipv6), 8080)
    # allowed: out of a by its group's rule, into b by b's, across both chains
    assert connects(w.ns(a), str(b.ipv6), 8080, timeout=3.0)
    assert peer_of(server) == str(a.ipv6)
    assert await drops(writer) == {}
    # a's rules allow no other port: its out- chain drops it
    listen(w.ns(b), str(b.ipv6), 8081)
    assert not connects(w.ns(a), str(b.ipv6), 8081)
    assert set(await drops(writer)) == {(f"out-{a.tap}", "no-rule", a.tap)}
    # c has the default group: out to anything not denied, but b's in- chain takes only clients
    assert not connects(w.ns(c), str(b.ipv6), 8080)
    assert (f"in-{b.tap}", "no-rule", b.tap) in await drops(writer)
    # nothing comes into a pod of the default group
    listen(w.ns(c), str(c.ipv6), 8080)
    assert not connects(w.ns(a), str(c.ipv6), 8080)
    server.close()


async def test_internet_masquerade_and_denied_prefixes(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    pod = w.add_pod(1)
    await load(w, writer)
    ns = w.ns(pod)
    server4, server6 = listen(w.inet, HOST4, 80), listen(w.inet, HOST6, 80)
    assert connects(ns, HOST4, 80, timeout=3.0)
    assert peer_of(server4) == NODE4  # IPv4 leaves masqueraded to the node's address
    assert connects(ns, HOST6, 80, timeout=3.0)
    assert peer_of(server6) == str(pod.ipv6)  # IPv6 is routed as it is
    listen(w.inet, DENIED4, 80)
    listen(w.inet, DENIED6, 80)
    assert not connects(ns, DENIED4, 80)
    assert not connects(ns, DENIED6, 80)
    assert not connects(ns, NODE6, 80)  # the node's own addresses are denied as well
    counts = await drops(writer)
    assert counts[(f"out-{pod.tap}", "deny", pod.tap)] >= 2
    assert set(counts) <= {(f"out-{pod.tap}", "deny", pod.tap), ("input", "input", None)}
    server4.close()
    server6.close()


async def test_link_local_and_metadata(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    firecracker, qemu = w.add_pod(1), w.add_pod(2, local_metadata=True)
    await load(w, writer)
    listen(w.inet, METADATA, 80)  # the node's cloud's metadata service, beyond the uplink
    assert not connects(w.ns(firecracker), METADATA, 80)
    assert (f"out-{firecracker.tap}", "deny", firecracker.tap) in await drops(writer)
    # the node's own metadata service answers the QEMU pod on its TAP
    service = listen(w.node, METADATA, 80, transparent=True)
    assert connects(w.ns(qemu), METADATA, 80, timeout=3.0)
    assert peer_of(service) == str(qemu.ipv4)
    service.close()


async def test_input_takes_dns_and_drops_the_rest(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    pod = w.add_pod(1)
    await load(w, writer)
    dns = sock(w.node, socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind((DNS, 53))
    dns.settimeout(2.0)
    query = sock(w.ns(pod), socket.AF_INET, socket.SOCK_DGRAM)
    query.sendto(b"q", (DNS, 53))
    assert dns.recvfrom(16) == (b"q", (str(pod.ipv4), query.getsockname()[1]))
    listen(w.node, DNS, 22)
    assert not connects(w.ns(pod), DNS, 22)
    assert set(await drops(writer)) == {("input", "input", None)}
    dns.close()
    query.close()


async def test_spoofed_sources_dropped(world: tuple[World, TableWriter]) -> None:
    w, writer = world
    pod = w.add_pod(1)
    await load(w, writer)
    ns = w.ns(pod)
    ns.run("ip", "addr", "add", "fd12:3456::99/128", "dev", "eth0", "nodad")
    listen(w.inet, HOST6, 80)
    assert connects(ns, HOST6, 80, timeout=3.0, source=str(pod.ipv6))
    assert not connects(ns, HOST6, 80, source="fd12:3456::99")
    # a pod's own multicast listener reports reach the node's input, which drops them
    assert set(await drops(writer)) - {("input", "input", None)} == {
        ("prerouting", "spoofed", None)
    }


async def test_pods_added_and_removed_by_deltas(world: tuple[World, TableWriter]) -> None:
    """The batch that adds a pod leaves what a full replace would, and the pod works at once."""
    w, writer = world
    a = w.add_pod(1, "client")
    assert await writer.write(compile_table(w.pod_nets(), GROUPS, FACTS)) == "full"
    b = w.add_pod(2, "web")
    table = compile_table(w.pod_nets(), GROUPS, FACTS)
    assert await writer.write(table) == "chains"
    server = listen(w.ns(b), str(b.ipv6), 8080)
    assert connects(w.ns(a), str(b.ipv6), 8080, timeout=3.0)
    by_delta = await writer.loader.read()
    await writer.write(table, full=True)
    by_full = await writer.loader.read()
    assert loaded_sets(by_delta) == loaded_sets(by_full)
    assert loaded_rules(by_delta) == loaded_rules(by_full)
    # the node's addresses change: elements alone
    moved = attrs.evolve(FACTS, node_addresses=(ip.ip_address("192.0.2.1"),))
    assert await writer.write(compile_table(w.pod_nets(), GROUPS, moved)) == "elements"
    assert NODE6 not in json.dumps(loaded_sets(await writer.loader.read())["deny6"])
    # b leaves: its chains and map elements go, a's rules stay
    del w.pods[b.tap]
    assert await writer.write(compile_table(w.pod_nets(), GROUPS, moved)) == "chains"
    rules = loaded_rules(await writer.loader.read())
    assert f"out-{b.tap}" not in rules
    assert f"out-{a.tap}" in rules
    server.close()


async def test_a_delta_against_a_changed_table_falls_back_to_full(
    world: tuple[World, TableWriter],
) -> None:
    w, writer = world
    a, _ = w.add_pod(1), w.add_pod(2, "web")
    await load(w, writer)
    # someone took an element away: the delta that removes it fails, and the writer replaces
    await writer.loader.run(f'delete element inet feos pod-out {{ "{a.tap}" }}\n')
    del w.pods[a.tap]
    table = compile_table(w.pod_nets(), GROUPS, FACTS)
    assert await writer.write(table) == "full"
    assert f"out-{a.tap}" not in loaded_rules(await writer.loader.read())
    with pytest.raises(FeosError) as e:
        await writer.loader.run("add rule inet feos nowhere accept\n")
    assert e.value.code == Code.INTERNAL
    assert "nowhere" in e.value.message or "No such file" in e.value.message
