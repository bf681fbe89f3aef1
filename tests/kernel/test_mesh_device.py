"""The mesh in namespaces: two nodes, each a namespace with its feos-mesh (wireguard-go, the
device this kernel can run), joined by a veth pair as their underlay; a "pod" is an address of the
node's /96 on its loopback. The device, its peers, its routes and the table's mesh rules, and
wireguard-go adopted by a second Mesh (a restart of feosd) with its sessions."""

from __future__ import annotations

import ipaddress as ip
import os
import socket
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import pytest

from conftest import Netns
from feos.errors import Code, FeosError
from feos.net._mesh import Mesh
from feos.net._nft import NodeFacts, compile_table
from feos.net._table import NftLoader, TableWriter, drop_counts
from feos.net._wireguard import UapiDevice, kernel_has_wireguard
from feos.net._wireguard_genl import GenlDevice

ULA = ip.IPv6Network("fd12:3456:789a:1::/64")
PREFIX = {"a": ip.IPv6Network("fd12:3456:789a:1:0:1::/96"),
          "b": ip.IPv6Network("fd12:3456:789a:1:0:2::/96")}
UNDERLAY = {"a": "10.77.0.1", "b": "10.77.0.2"}


def pod_address(node: str) -> str:
    return str(PREFIX[node][5])


@attrs.define
class Node:
    name: str
    ns: Netns
    dir: Path
    mesh: Mesh

    def again(self) -> Mesh:
        """A Mesh of a feosd started anew on the same directories."""
        return Mesh(self.dir / "node" / "mesh", self.dir / "run", 51820, netns=self.ns.name)

    def peer(self) -> dict[str, object]:
        return {"publicKey": self.mesh.state.public_key, "endpoint": f"{UNDERLAY[self.name]}:51820",
                "prefix": str(PREFIX[self.name])}

    def pings(self, other: Node) -> bool:
        done = self.ns.run("ping", "-6", "-c", "1", "-W", "2", "-I", pod_address(self.name),
                           pod_address(other.name), check=False)
        return done.returncode == 0


@pytest.fixture
async def nodes(make_netns: Callable[[str], Netns], tmp_path: Path
                ) -> AsyncIterator[dict[str, Node]]:
    made: dict[str, Node] = {}
    a, b = make_netns("ma"), make_netns("mb")
    a.run("ip", "link", "add", "under", "type", "veth", "peer", "name", "under", "netns", b.name)
    for name, ns in (("a", a), ("b", b)):
        ns.run("ip", "addr", "add", f"{UNDERLAY[name]}/24", "dev", "under")
        ns.run("ip", "link", "set", "under", "up")
        ns.run("ip", "addr", "add", f"{pod_address(name)}/128", "dev", "lo")
        made[name] = Node(name, ns, tmp_path / name,
                          Mesh(tmp_path / name / "node" / "mesh", tmp_path / name / "run", 51820,
                               netns=ns.name))
    try:
        for node in made.values():
            await node.mesh.start()
            await node.mesh.take_join({"meshed": True, "ula": str(ULA),
                                       "prefix": str(PREFIX[node.name])})
        yield made
    finally:
        for node in made.values():
            device = node.mesh.device
            assert isinstance(device, UapiDevice)
            device.stop()


async def joined(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await a.mesh.put_mesh_peers({"version": 1, "peers": [b.peer()]})
    await b.mesh.put_mesh_peers({"version": 1, "peers": [a.peer()]})


async def test_the_device(nodes: dict[str, Node]) -> None:
    a = nodes["a"]
    link = a.ns.run("ip", "-d", "link", "show", "feos-mesh").stdout
    assert "mtu 1420" in link and "UP" in link
    assert a.ns.run("ip", "addr", "show", "dev", "feos-mesh").stdout.count("inet") == 0
    accept_ra = a.ns.run("sysctl", "-n", "net.ipv6.conf.feos-mesh.accept_ra").stdout.strip()
    assert accept_ra == "0"
    key = a.dir / "node" / "mesh" / "key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    state = a.mesh.device.read()
    assert state.port == 51820
    assert state.public_key == a.mesh.state.public_key
    route = a.ns.run("ip", "-6", "route", "show", str(ULA)).stdout
    assert "dev feos-mesh" in route and "mtu 1420" in route


async def test_peers_reach_each_other_over_the_ula(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    assert not a.pings(b)
    await joined(nodes)
    assert a.pings(b) and b.pings(a)
    (peer,) = a.mesh.device.read().peers
    assert peer.allowed == (str(PREFIX["b"]),) and peer.endpoint == "10.77.0.2:51820"


async def test_a_source_outside_the_peers_prefix_is_not_taken(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    outside = str(PREFIX["a"].supernet(new_prefix=80)[2**16 - 1])  # the ULA, not a's /96
    a.ns.run("ip", "addr", "add", f"{outside}/128", "dev", "lo")
    a.ns.run("ip", "-6", "route", "replace", str(PREFIX["b"]), "dev", "feos-mesh")
    done = a.ns.run("ping", "-6", "-c", "1", "-W", "2", "-I", outside, pod_address("b"),
                    check=False)
    assert done.returncode != 0  # b's WireGuard takes from a only a source in a's /96
    assert b.pings(a)


async def test_a_peer_removed_cuts_the_path_and_one_that_stays_keeps_its_session(
        nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    assert a.pings(b)
    (before,) = a.mesh.device.read().peers
    third = {"publicKey": os.urandom(32), "endpoint": "10.77.0.3:51820",
             "prefix": "fd12:3456:789a:1:0:3::/96"}
    await a.mesh.update_mesh_peers({"fromVersion": 1, "toVersion": 2, "put": [third]})
    kept = {p.public_key: p for p in a.mesh.device.read().peers}[before.public_key]
    assert kept.last_handshake_s == before.last_handshake_s != 0
    await a.mesh.update_mesh_peers({"fromVersion": 2, "toVersion": 3,
                                    "remove": [b.mesh.state.public_key]})
    assert [p.endpoint for p in a.mesh.device.read().peers] == ["10.77.0.3:51820"]
    assert not a.pings(b)
    with pytest.raises(FeosError) as got:
        await a.mesh.update_mesh_peers({"fromVersion": 2, "toVersion": 4, "put": [b.peer()]})
    assert got.value.code == Code.FAILED_PRECONDITION


async def test_bad_peers_leave_the_device_unchanged(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    before = a.mesh.device.read().peers
    bad = [b.peer(), {"publicKey": os.urandom(32), "endpoint": "10.77.0.9:1",
                      "prefix": "fd99::/96"}]
    with pytest.raises(FeosError) as got:
        await a.mesh.put_mesh_peers({"version": 2, "peers": bad})
    assert got.value.code == Code.INVALID_ARGUMENT and "peers[1].prefix" in got.value.message
    assert a.mesh.device.read().peers == before and a.mesh.state.version == 1


async def test_a_restart_adopts_wireguard_go_and_keeps_the_sessions(
        nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    assert a.pings(b)
    device = a.mesh.device
    assert isinstance(device, UapiDevice)
    pid = device.pid
    (before,) = device.read().peers
    a.mesh.close()
    again = a.again()
    await again.start()
    assert isinstance(again.device, UapiDevice) and again.device.pid == pid
    assert again.prefix == PREFIX["a"] and again.state.version == 1
    (after,) = again.device.read().peers
    assert after.last_handshake_s == before.last_handshake_s
    assert a.pings(b)
    a.mesh = again


async def test_peers_reapplied_to_a_new_device_at_start(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    device = a.mesh.device
    assert isinstance(device, UapiDevice)
    device.stop()  # wireguard-go gone (a reboot): the next start makes it and gives it the peers
    again = a.again()
    await again.start()
    a.mesh = again
    assert [p.endpoint for p in again.device.read().peers] == ["10.77.0.2:51820"]
    assert a.pings(b)


async def test_routes_an_earlier_prefix_left_are_removed(nodes: dict[str, Node]) -> None:
    a = nodes["a"]
    ns = a.ns
    ns.run("ip", "-6", "route", "add", "fd12:3456:789a:7::/64", "dev", "feos-mesh")
    ns.run("ip", "-6", "route", "add", "unreachable", "fd12:3456:789a:1:0:9::/96")
    ns.run("ip", "-6", "route", "add", "unreachable", str(PREFIX["a"]))
    ns.run("ip", "-6", "route", "add", "unreachable", "fd99::/96")  # not in the ULA's /48
    again = a.again()
    await again.start()
    a.mesh = again
    routes = ns.run("ip", "-6", "route", "show").stdout
    assert "fd12:3456:789a:7::/64" not in routes
    assert "fd12:3456:789a:1:0:9::/96" not in routes
    assert f"unreachable {PREFIX['a']}" in routes and "unreachable fd99::/96" in routes
    assert f"{ULA} dev feos-mesh" in routes


async def test_a_ula_source_through_another_device_is_dropped(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    await joined(nodes)
    # a sends to b's pod over the underlay, from an address of the mesh: a spoof of the ULA
    mac = b.ns.run("cat", "/sys/class/net/under/address").stdout.strip()
    a.ns.run("ip", "-6", "route", "add", f"{pod_address('b')}/128", "dev", "under")
    a.ns.run("ip", "-6", "neigh", "add", pod_address("b"), "lladdr", mac, "dev", "under")
    assert udp_arrives(a, b)  # without the table b takes it
    loader = NftLoader(b.ns.name)
    try:
        writer = TableWriter(loader)
        facts = NodeFacts(PREFIX["b"], mesh_prefix=ULA,
                          mesh_endpoints=(ip.ip_address(UNDERLAY["a"]),))
        await writer.write(compile_table([], {}, facts))
        assert not udp_arrives(a, b)
        assert drop_counts(await loader.read()).get(("prerouting", "spoofed", None))
        await b.mesh.put_mesh_peers({"version": 2, "peers": [a.peer()]})
        a.ns.run("ip", "-6", "route", "del", f"{pod_address('b')}/128", "dev", "under")
        assert a.pings(b)  # through feos-mesh the same source passes
        assert UNDERLAY["a"] in (await loader.run("list set inet feos deny4"))
    finally:
        loader.close()


def udp_arrives(a: Node, b: Node) -> bool:
    from test_nft_packets import in_netns

    def bound() -> socket.socket:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind((pod_address("b"), 9999))
        s.settimeout(1.5)
        return s

    server = in_netns(b.ns.name, bound)
    try:
        def send() -> None:
            with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
                s.bind((pod_address("a"), 0))
                s.sendto(b"spoof", (pod_address("b"), 9999))

        in_netns(a.ns.name, send)
        try:
            return server.recv(64) == b"spoof"
        except TimeoutError:
            return False
    finally:
        server.close()


@pytest.mark.skipif(not kernel_has_wireguard(),
                    reason="this kernel has no WireGuard, so the generic-netlink backend cannot "
                           "run here; its messages are tested against pyroute2's encoder "
                           "(tests/unit/test_mesh_genl.py)")
async def test_the_kernel_device(make_netns: Callable[[str], Netns]) -> None:
    ns = make_netns("mk")
    device = GenlDevice(ns.name)
    key = os.urandom(32)
    device.ensure(key, 51820)
    assert device.read().port == 51820
