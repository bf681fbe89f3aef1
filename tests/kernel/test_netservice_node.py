"""The whole pods' network service in a throwaway node namespace: start-up, a pod allocated,
prepared and removed, the resolver and the traffic records with a namespace standing for a pod,
and a restart that keeps the addresses and the rules.

A TAP carries packets only with a VMM on its other end, and no VMM runs here: the pod that is
dug from and that opens connections is a namespace behind a veth pair whose node end is named
pod-<ID> and which `prepare` completes as it completes a TAP (addresses, sysctls, the proxy
neighbour, routes). The TAP the service makes itself is checked as made (its kind, owner,
addresses, routes, proxy entry), and its metadata server listening on it.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from feos.errors import Code, FeosError
from feos.net import PodNet
from feos.net._options import parse_network_options
from feos.net._service import Network
from feos.net._stores import NameTableService, SecurityGroupService

PREFIX = "2001:db8:7::/64"
OPTIONS = parse_network_options(pod_prefix=PREFIX)
SERVER = "10.99.0.2"
TAPPED, VETHED = "abcdefghjkm", "bcdefghjkmn"

SERVE = textwrap.dedent(f"""
    import http.server, socketserver
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
            self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    socketserver.TCPServer.allow_reuse_address = True
    s = socketserver.TCPServer(("{SERVER}", 8080), H)  # HTTPServer's getfqdn waits on DNS
    print("ready", flush=True)
    s.serve_forever()
""")


class View:
    """The pod service's side: the pods it keeps."""

    def __init__(self) -> None:
        self.pods: dict[str, PodNet] = {}

    def network_pods(self) -> list[PodNet]:
        return list(self.pods.values())


def pod(pod_id: str, **kw: Any) -> PodNet:
    base = dict(id=pod_id, ipv6="", ipv4="", security_groups=(), name_tables=("t1",),
                dns_upstreams=(), metadata_json='{"role": "web"}', driver="qemu")
    base.update(kw)
    return PodNet(**base)  # type: ignore[arg-type]


@attrs.define
class World:
    node: Any
    pod: Any
    server: Any
    state: Path
    view: View
    groups: SecurityGroupService
    names: NameTableService
    nursery: trio.Nursery
    net: Network | None = None

    async def start(self, nursery: trio.Nursery | None = None) -> Network:
        # A second start takes the first one's resolver sockets, as a restarted feosd is handed
        # them (a second listener could not bind the same address and port).
        sockets = self.net.dns_sockets if self.net is not None else None
        net = Network(OPTIONS, self.state, self.view, self.groups, self.names,
                      netns=self.node.name, dns_sockets=sockets, table_interval=3600)
        await (nursery or self.nursery).start(net.run)
        self.net = net
        return net


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[SecurityGroupService, NameTableService]]:
    groups = SecurityGroupService(tmp_path, in_use=lambda _id: [])
    names = NameTableService(tmp_path, in_use=lambda _id: [])
    groups.load()
    names.load()
    yield groups, names
    groups.close()
    names.close()


@pytest.fixture
async def world(make_netns: Any, tmp_path: Path, stores: Any) -> AsyncIterator[World]:
    node, podns, server = make_netns("node"), make_netns("pod"), make_netns("srv")
    node.run("ip", "link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns",
             server.name)
    node.run("ip", "addr", "add", "10.99.0.1/24", "dev", "up0")
    node.run("ip", "link", "set", "up0", "up")
    node.run("ip", "route", "add", "default", "via", SERVER)  # the proxy ARP needs one
    server.run("ip", "addr", "add", f"{SERVER}/24", "dev", "up1")
    server.run("ip", "link", "set", "up1", "up")
    server.run("ip", "route", "add", "default", "via", "10.99.0.1")
    groups, names = stores
    await names.put_name_table({"table": {"id": "t1", "version": 1, "names": [
        {"name": "web", "addresses": ["2001:db8:99::5", SERVER]}]}})
    srv = server.popen(sys.executable, "-c", SERVE, stdout=subprocess.PIPE)
    try:
        assert srv.stdout is not None and srv.stdout.readline() == b"ready\n"
        async with trio.open_nursery() as nursery:
            w = World(node, podns, server, tmp_path, View(), groups, names, nursery)
            yield w
            nursery.cancel_scope.cancel()
        if w.net is not None and w.net.dns_sockets is not None:
            w.net.dns_sockets.close()
    finally:
        srv.kill()
        srv.wait()
        if srv.stdout is not None:
            srv.stdout.close()


def veth_pod(w: World, p: PodNet) -> None:
    """The pod's namespace behind a veth whose node end is the pod's link (see the docstring)."""
    tap = f"pod-{p.id}"
    w.node.run("ip", "link", "add", tap, "type", "veth", "peer", "name", "eth0", "netns",
               w.pod.name)
    w.pod.run("ip", "addr", "add", f"{p.ipv4}/32", "dev", "eth0")
    w.pod.run("ip", "addr", "add", f"{p.ipv6}/128", "dev", "eth0", "nodad")
    w.pod.run("ip", "link", "set", "eth0", "up")
    w.pod.run("ip", "route", "add", "169.254.0.1", "dev", "eth0")
    w.pod.run("ip", "route", "add", "default", "via", "169.254.0.1", "dev", "eth0")


def dig(ns: Any, name: str, qtype: str) -> str:
    return ns.run("dig", "+time=2", "+tries=1", "@169.254.0.53", name, qtype, check=False).stdout


async def _dig_into(answers: list[str], ns: Any, name: str, qtype: str) -> None:
    answers.append(await trio.to_thread.run_sync(dig, ns, name, qtype))


async def _query_queued(node: Any) -> None:
    """Until a query waits unread in the resolver's UDP socket (its Recv-Q is not 0)."""
    with trio.fail_after(2):  # dig's own timeout: past it, its query was read or never sent
        while True:
            listing = node.run("ss", "-Hlnu", "src", "169.254.0.53", "sport", "53").stdout
            if any(line.split()[1] != "0" for line in listing.splitlines()):
                return
            await trio.sleep(0.01)


def chains(w: World) -> set[str]:
    listing = json.loads(w.node.run("nft", "-j", "list", "table", "inet", "feos").stdout)
    return {i["chain"]["name"] for i in listing["nftables"] if "chain" in i}


async def test_start_up_steps_and_the_table(world: World) -> None:
    n = world.node
    # what the first version (a bridge and its table) and the NAT64 version (a counter) left
    n.run("ip", "link", "add", "feos-pods", "type", "bridge")
    n.run("nft", "add", "table", "bridge", "feos")
    (world.state / "pods").mkdir()
    (world.state / "pods" / "next-address").write_text("10.200.0.9\n")
    net = await world.start()
    assert net.unavailable() is None
    assert n.run("ip", "link", "show", "feos-pods", check=False).returncode != 0
    assert n.run("nft", "list", "table", "bridge", "feos", check=False).returncode != 0
    assert not (world.state / "pods" / "next-address").exists()
    assert "169.254.0.1/" not in n.run("ip", "-4", "addr").stdout  # never the node's
    assert n.run("sysctl", "-n", "net.ipv4.ip_forward").stdout.strip() == "1"
    assert n.run("sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip() == "1"
    assert f"unreachable {PREFIX}" in n.run("ip", "-6", "route", "show", "type",
                                             "unreachable").stdout
    dns_dev = n.run("ip", "-4", "-o", "addr", "show", "dev", "feos-dns").stdout
    assert "169.254.0.53/32" in dns_dev and "169.254.169.1/32" in dns_dev
    sockets = n.run("ss", "-lnu").stdout + n.run("ss", "-lnt").stdout
    assert sockets.count("169.254.0.53:53") == 2
    assert {"prerouting", "input", "forward", "postrouting", "from-pods", "to-pods"} <= chains(
        world)
    # node.md: the node's own addresses are denied to pods
    assert "10.99.0.1" in n.run("nft", "list", "set", "inet", "feos", "deny4").stdout


async def test_a_pod_allocated_prepared_and_removed(world: World) -> None:
    net = await world.start()
    n = world.node
    a = await net.allocate(pod(TAPPED, tap_owner_uid=4242))
    assert (a.ipv6, a.ipv4) == ("2001:db8:7::2", "169.254.16.1")
    assert await net.allocate(a) == a  # kept addresses are kept
    assert (world.state / "pods" / "next-ipv6-address").read_text() == "2001:db8:7::3\n"
    world.view.pods[a.id] = a
    link = await net.prepare(a)
    tap = f"pod-{TAPPED}"
    assert link.tap == tap and link.mac.startswith("06:00:")
    details = n.run("ip", "-d", "link", "show", tap).stdout
    assert "tun type tap" in details and "user 4242" in details
    v4 = n.run("ip", "-4", "-o", "addr", "show", "dev", tap).stdout.splitlines()
    assert [line.split()[3] for line in v4] == ["169.254.0.53/32", "169.254.169.1/32"]
    assert "inet6 fe80::1/64" in n.run("ip", "-6", "addr", "show", "dev", tap).stdout
    assert f"2001:db8:7::2 dev {tap}" in n.run("ip", "-6", "route").stdout
    assert f"169.254.16.1 dev {tap}" in n.run("ip", "-4", "route").stdout
    assert f"169.254.0.1 dev {tap} proxy" in n.run("ip", "neigh", "show", "proxy").stdout
    assert {f"out-{tap}", f"in-{tap}"} <= chains(world)
    assert f"169.254.169.254%{tap}:80" in n.run("ss", "-ltnH").stdout  # its metadata service
    g = net.guest_network(a)
    assert (g.ipv6, g.ipv4, g.resolver, g.ula_only) == (a.ipv6, a.ipv4, "169.254.0.53", False)

    await net.remove(a)
    del world.view.pods[a.id]
    assert n.run("ip", "link", "show", tap, check=False).returncode != 0
    assert tap not in n.run("ip", "neigh", "show", "proxy").stdout
    assert "2001:db8:7::2" not in n.run("ip", "-6", "route").stdout
    assert not {f"out-{tap}", f"in-{tap}"} & chains(world)
    assert f"%{tap}" not in n.run("ss", "-ltnH").stdout
    pool = json.loads((world.state / "pods" / "ipv4-addresses").read_text())
    assert [a for a, _ in pool["free"]] == ["169.254.16.1"]
    await net.remove(a)  # idempotent


async def test_missing_groups_and_tables_fail_the_prepare(world: World) -> None:
    net = await world.start()
    p = await net.allocate(pod(TAPPED, security_groups=("web",), name_tables=("t1", "t9")))
    with pytest.raises(FeosError) as e:
        await net.prepare(p)
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "security groups web" in e.value.message and "name tables t9" in e.value.message
    assert world.node.run("ip", "link", "show", f"pod-{TAPPED}", check=False).returncode != 0


async def _records(stream: Any, want: Any, wait: float = 8.0) -> list[Any]:
    got: list[Any] = []
    with trio.move_on_after(wait):
        while not want(got):
            got += (await stream.next({"max": 64}))["records"]
    return got


async def test_the_resolver_and_traffic_of_a_pod(world: World) -> None:
    net = await world.start()
    p = await net.allocate(pod(VETHED, driver="firecracker"))
    world.view.pods[p.id] = p
    veth_pod(world, p)
    await net.prepare(p)
    # Until the pods are loaded the resolver reads nothing: dig runs on a worker thread while
    # the resolver runs here, its query waits unread in the socket's buffer, and the answer
    # comes once the pods are loaded (a resolver that read it earlier fails the wait).
    stream = net.traffic.open_stream(VETHED)
    async with trio.open_nursery() as nursery:
        answers: list[str] = []
        nursery.start_soon(_dig_into, answers, world.pod, "web", "A")
        await _query_queued(world.node)
        assert answers == []
        net.pods_loaded()
    answer = answers[0]
    assert re.search(rf"^web\.\s+5\s+IN\s+A\s+{SERVER}$", answer, re.M) and " aa " in answer
    assert "2001:db8:99::5" in await trio.to_thread.run_sync(dig, world.pod, "web", "AAAA")
    assert "status: REFUSED" in await trio.to_thread.run_sync(dig, world.server, "web", "A")

    done = await trio.run_process(["ip", "netns", "exec", world.pod.name, "curl", "-sS", "-m",
                                   "3", f"http://{SERVER}:8080/"], capture_stdout=True)
    assert done.stdout == b"ok"
    await net.remove(p)  # its connections are deleted: their ends become its flows
    got = await _records(stream, lambda g: any(r.get("flow") for r in g))
    kinds = [next(k for k in ("flow", "drop", "serverName", "dnsQuery") if k in r) for r in got]
    assert "dnsQuery" in kinds and "flow" in kinds
    dns = [r["dnsQuery"] for r in got if "dnsQuery" in r]
    assert {(q["podId"], q["name"], q["type"]) for q in dns} >= {(VETHED, "web.", 1)}
    flow = next(r["flow"] for r in got if "flow" in r)
    assert flow["podId"] == VETHED
    assert flow["source"].startswith(f"{p.ipv4}:") and flow["destination"] == f"{SERVER}:8080"
    assert flow["bytesOut"] > 50 and flow["bytesIn"] > 50
    assert world.node.run("conntrack", "-L", "-s", p.ipv4, check=False).stdout.strip() == ""
    stream.close()


async def test_a_restart_keeps_addresses_and_rules(world: World) -> None:
    async with trio.open_nursery() as first:
        net = await world.start(first)
        kept = await net.allocate(pod(TAPPED))
        world.view.pods[kept.id] = kept
        await net.prepare(kept)
        gone = await net.allocate(pod(VETHED))
        await net.remove(gone)  # its IPv4 address is free, its IPv6 address never comes back
        first.cancel_scope.cancel()  # feosd ends; the TAP and the table stay
    assert f"out-pod-{TAPPED}" in chains(world)
    assert net.unavailable() is not None

    async with trio.open_nursery() as nursery:
        again = await world.start(nursery)
        assert f"out-pod-{TAPPED}" in chains(world)  # written whole at the start, with it
        assert await again.allocate(kept) == kept
        new = await again.allocate(pod("cdefghjkmnp"))
        assert ipaddress.IPv6Address(new.ipv6) == ipaddress.IPv6Address("2001:db8:7::4")
        assert new.ipv4 == "169.254.16.3"  # never handed out comes before the freed .2
        pool = json.loads((world.state / "pods" / "ipv4-addresses").read_text())
        assert [a for a, _ in pool["free"]] == [gone.ipv4]
        nursery.cancel_scope.cancel()


def out_chain(w: World, pod_id: str) -> str:
    return w.node.run("nft", "list", "chain", "inet", "feos", f"out-pod-{pod_id}").stdout


async def test_a_group_change_rewrites_the_pods_rules(world: World) -> None:
    net = await world.start()
    rule = {"protocol": "tcp", "firstPort": 443, "lastPort": 443,
            "peer": {"block": {"cidr": "2001:db8:50::/48"}}}
    await world.groups.put_security_group({"group": {"id": "web", "rulesOut": [rule]}})
    p = await net.allocate(pod(TAPPED, security_groups=("web",)))
    world.view.pods[p.id] = p
    await net.prepare(p)
    assert "tcp dport 443 return" in out_chain(world, TAPPED)
    rule["firstPort"] = rule["lastPort"] = 8443
    await world.groups.put_security_group({"group": {"id": "web", "rulesOut": [rule]}})
    with trio.fail_after(5):  # the store's on_change wakes the table's loop
        while "tcp dport 8443 return" not in out_chain(world, TAPPED):  # noqa: ASYNC110 (the kernel's table)
            await trio.sleep(0.05)
    assert "dport 443 " not in out_chain(world, TAPPED)


async def test_the_table_is_written_whole_again_on_its_interval(world: World) -> None:
    net = Network(OPTIONS, world.state, world.view, world.groups, world.names,
                  netns=world.node.name, table_interval=0.3)
    await world.nursery.start(net.run)
    world.net = net
    world.node.run("nft", "delete", "table", "inet", "feos")  # drift: someone removed it
    with trio.fail_after(5):
        while world.node.run("nft", "list", "table", "inet", "feos", check=False).returncode:  # noqa: ASYNC110
            await trio.sleep(0.1)
    assert {"forward", "from-pods"} <= chains(world)


async def test_a_failed_start_leaves_the_network_unavailable(tmp_path: Path, stores: Any) -> None:
    groups, names = stores
    net = Network(OPTIONS, tmp_path, View(), groups, names, netns="feostest-no-such-namespace")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)  # reports started: feosd runs on
    reason = net.unavailable()
    assert reason is not None and reason.startswith("the pods' network could not be set up")
    with pytest.raises(FeosError) as e:
        net.check_spec(pod(TAPPED))
    assert e.value.code == Code.FAILED_PRECONDITION and e.value.message == reason
