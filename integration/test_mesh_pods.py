"""Two nodes on one mesh, a QEMU pod on each (boots two microVMs, at once: run under
/tmp/feos-vm.lock).

Each node is an integration/podnet.PodNet without --pod-prefix (a node namespace where feosd runs
with a hostname of its own, an internet namespace with its registry and resolver), the two node
namespaces joined by a veth pair, `under`, their underlay. The test control plane
(tests/controlplane.py) listens on node A's end of it, 10.88.0.1, so both nodes dial it there and
each finds its mesh endpoint as the address it reaches the control plane from (10.88.0.1 and
10.88.0.2, port 51820). It hands each node a /96 of its ULA and pushes each the other as its peer.

- SERVER on B, group "web": HTTP on 8080, let in from the cluster's ULA on 8080 only.
- CLIENT on A, group "client": out to the ULA on 8080 (and 8081, which web does not let in).
Both reach IPv4 (the registry their guests pull from), masqueraded as on any node.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from _netpods import POD_PORT, block, create_pods, in_pod_connect, in_pod_get, pod_spec, rule
from podnet import IMAGE, PodNet, sh

from feos.net import UapiDevice
from feos.net._table import NftLoader, drop_counts

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from controlplane import ControlPlane

pytestmark = pytest.mark.integration
CLIENT, SERVER = "mc0000000aa", "ms0000000bb"
ULA = "fd12:3456:789a:1::/64"
UNDER = {"a": "10.88.0.1", "b": "10.88.0.2"}
OTHER_PORT = 8081
DROPPED = "nc: timed out"
IPV4_OUT = [rule("any", block("0.0.0.0/0"))]  # the registry, which the guests pull from
GROUPS = {
    "a": {"id": "client", "rulesIn": [], "rulesOut": [
        rule("tcp", block(ULA), POD_PORT), rule("tcp", block(ULA), OTHER_PORT), *IPV4_OUT]},
    "b": {"id": "web", "rulesIn": [rule("tcp", block(ULA), POD_PORT)], "rulesOut": IPV4_OUT},
}


@attrs.define
class Mesh:
    cp: ControlPlane
    nodes: dict[str, PodNet]
    pods: dict[str, Any]

    def server(self) -> str:
        return str(self.pods[SERVER]["ipv6Address"])

    def reaches(self, port: int = POD_PORT) -> str:
        return in_pod_connect(self.nodes["a"], CLIENT, self.server(), port, wait=3)

    def name(self, node: str) -> str:
        return f"mesh-{node}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("mesh")
    nodes = {n: PodNet(root / n, pod_prefix=None, hostname=f"mesh-{n}") for n in ("a", "b")}
    cp: ControlPlane | None = None
    try:
        for net in nodes.values():
            net.start(feosd=False)
        a, b = nodes["a"].node_ns, nodes["b"].node_ns
        sh("ip", "-n", a, "link", "add", "under", "type", "veth", "peer", "name", "under",
           "netns", b)
        for n, net in nodes.items():
            sh("ip", "-n", net.node_ns, "addr", "add", f"{UNDER[n]}/24", "dev", "under")
            sh("ip", "-n", net.node_ns, "link", "set", "under", "up")
        cp = ControlPlane(root / "cp", netns=a, host=UNDER["a"],
                          port=40000 + secrets.randbelow(20000), ula=ULA).start()
        (root / "join-token").write_text(cp.token() + "\n")
        for net in nodes.values():
            net.feosd.args += ["--control-plane", cp.address, "--control-plane-name",
                               cp.ca.server_name, "--join-token-file", str(root / "join-token")]
            net.start_feosd()
        cp.wait_for(lambda: len(cp.mesh_nodes) == 2, timeout=60, why="both nodes' JoinMesh")
        for net in nodes.values():
            wait_network(net)
        cp.put_mesh_peers(1)
        for n, net in nodes.items():
            net.ctl("group", "put", net.spec_file("group", GROUPS[n]))
        specs = {"a": {CLIENT: pod_spec(IMAGE, ["sleep", "3600"], groups=["client"])},
                 "b": {SERVER: pod_spec(
                     IMAGE, ["/bin/sh", "-c", "busybox mkdir -p /www && echo hello-over-the-mesh "
                             f"> /www/index.html && exec busybox httpd -f -p {POD_PORT} -h /www"],
                     groups=["web"])}}
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:  # both boots at once
            made = pool.map(lambda n: create_pods(nodes[n], specs[n]), specs)
            pods = {pod_id: pod for each in made for pod_id, pod in each.items()}
        yield Mesh(cp, nodes, pods)
    finally:
        for net in nodes.values():
            net.close()
        if cp is not None:
            cp.stop()


def wait_network(net: PodNet, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if net.ctl_json("host", "info")["version"]["network"] == "up":
            return
        time.sleep(0.3)
    raise AssertionError(f"the network of {net.node_ns} did not come up with the mesh's /96")


def test_each_node_has_its_96_and_the_other_as_its_peer(mesh: Mesh) -> None:
    for n, net in mesh.nodes.items():
        shown = net.ctl_json("mesh", "show")
        other = "b" if n == "a" else "a"
        assert shown["ula"] == ULA
        assert shown["nodePrefix"] == mesh.cp.mesh_nodes[mesh.name(n)]["prefix"]
        assert [p["endpoint"] for p in shown["peers"]] == [f"{UNDER[other]}:51820"]
        info = net.ctl_json("host", "info")
        assert info["meshDevice"].startswith("wireguard-go")
        routes = sh("ip", "-n", net.node_ns, "-6", "route", "show")
        assert f"{ULA} dev feos-mesh" in routes and f"unreachable {shown['nodePrefix']}" in routes
    for pod_id, n in ((CLIENT, "a"), (SERVER, "b")):
        prefix = ipaddress.IPv6Network(mesh.cp.mesh_nodes[mesh.name(n)]["prefix"])
        assert ipaddress.IPv6Address(mesh.pods[pod_id]["ipv6Address"]) in prefix


def test_a_pod_reaches_the_other_nodes_pod_where_the_groups_allow(mesh: Mesh) -> None:
    assert "hello-over-the-mesh" in in_pod_get(mesh.nodes["a"], CLIENT, mesh.server())
    assert mesh.reaches(OTHER_PORT) == DROPPED  # web lets in 8080 alone


def test_a_ula_source_through_another_device_is_dropped(mesh: Mesh) -> None:
    """Node A sends to B's pod by the underlay from an address of its /96: B's prerouting drops
    it (its route for the source is feos-mesh), counted as spoofed."""
    a, b = mesh.nodes["a"], mesh.nodes["b"]
    source = str(ipaddress.IPv6Network(mesh.cp.mesh_nodes[mesh.name("a")]["prefix"])[0x99])
    target = mesh.server()
    mac = sh("ip", "netns", "exec", b.node_ns, "cat", "/sys/class/net/under/address").strip()
    before = spoofed(b)
    node = ("ip", "-n", a.node_ns, "-6")
    sh(*node, "addr", "add", f"{source}/128", "dev", "lo")
    sh(*node, "route", "add", f"{target}/128", "dev", "under", "table", "77")
    sh(*node, "neigh", "replace", target, "lladdr", mac, "dev", "under")
    sh(*node, "rule", "add", "from", source, "to", target, "table", "77", "priority", "77")
    try:
        sh("ip", "netns", "exec", a.node_ns, "ping", "-6", "-c", "3", "-W", "1", "-I", source,
           target, check=False)
        assert spoofed(b) >= before + 3
    finally:
        sh(*node, "rule", "del", "priority", "77")
        sh(*node, "addr", "del", f"{source}/128", "dev", "lo")
    assert "hello-over-the-mesh" in in_pod_get(a, CLIENT, target)  # the mesh itself passes


def spoofed(net: PodNet) -> int:
    async def read() -> int:
        loader = NftLoader(net.node_ns)
        try:
            return drop_counts(await loader.read()).get(("prerouting", "spoofed", None), 0)
        finally:
            loader.close()

    return trio.run(read)


def test_a_removed_peer_cuts_the_path(mesh: Mesh) -> None:
    a_key = mesh.cp.mesh_nodes[mesh.name("a")]["publicKey"]
    mesh.cp.push("mesh", "updateMeshPeers", {"fromVersion": 1, "toVersion": 2, "remove": [a_key]},
                 node=mesh.name("b"))
    try:
        assert mesh.nodes["b"].ctl_json("mesh", "show")["peers"] == []
        assert mesh.reaches() == DROPPED
        stale = mesh.cp.push("mesh", "updateMeshPeers", {"fromVersion": 1, "toVersion": 3},
                             node=mesh.name("b"))
        assert stale["status"]["code"] == "failedPrecondition", stale
    finally:
        mesh.cp.push("mesh", "putMeshPeers", {"version": 3, "peers": mesh.cp.mesh_peers_of(
            mesh.name("b"))}, node=mesh.name("b"))
    # A's session went with B's peer: A's WireGuard handshakes anew once its packets go
    # unanswered (KEEPALIVE_TIMEOUT + REKEY_TIMEOUT, 15 s), and the path is back
    deadline = time.monotonic() + 60
    while mesh.reaches() != "connected":
        assert time.monotonic() < deadline, "the path did not come back with the peer"



def test_a_restart_of_feosd_keeps_the_mesh_and_its_sessions(mesh: Mesh) -> None:
    a = mesh.nodes["a"]
    assert mesh.reaches() == "connected"
    pid = int((a.feosd.run_dir / "mesh" / "wireguard-go.pid").read_text())
    handshake = last_handshake(a)
    assert handshake
    assert a.stop_feosd() == 0
    # feosd away: wireguard-go and its device carry on
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/usr/bin/wireguard-go")
    assert "feos-mesh" in a.links()
    a.start_feosd()
    wait_network(a)
    assert int((a.feosd.run_dir / "mesh" / "wireguard-go.pid").read_text()) == pid
    assert "adopted" in a.feosd.log_text()
    assert last_handshake(a) == handshake  # the same session: no handshake anew
    assert mesh.reaches() == "connected"
    assert a.ctl_json("mesh", "show")["version"] == 1


def last_handshake(net: PodNet) -> int:
    """The peer's last handshake, as wireguard-go's UAPI socket says it (feos.net's reader)."""
    device = UapiDevice(net.feosd.run_dir / "mesh")
    return max((p.last_handshake_s for p in device.read().peers), default=0)
