"""The resolver on real sockets: a node namespace holding the resolver's address, a pod's namespace
that queries it with dig, and an upstream namespace where dnsmasq answers without any upstream."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import trio

from conftest import Netns, run
from feos.net import _dnsmsg as m
from feos.net._dnscache import AnswerCache
from feos.net._dnsresolver import PodDns, QueryRecord
from feos.net._dnsserver import DnsServer
from feos.net._links import netns_entered
from feos.net._listenfds import bind_dns_sockets
from feos.net._nametable import NameTable

RESOLVER = ipaddress.IPv4Address("169.254.0.53")
POD_IP, STRANGER_IP = "169.254.16.5", "169.254.16.99"
UP4, UP6, DEAD4 = "10.53.0.2", "fd53::2", "10.53.0.9"


def in_netns(ns: Netns) -> contextlib.AbstractContextManager[None]:
    """This thread in the namespace for the block: sockets made in it stay there."""
    return netns_entered(ns.name)


def ech_https_hex() -> str:
    params = ((1, b"\x02h2"), (4, bytes([192, 0, 2, 7])), (m.SVC_ECH, b"\x00\x08ECHCONFG"))
    return m.build_svcb(m.Svcb(1, (), params)).hex()


@pytest.fixture
def topology(make_netns: Callable[[str], Netns], tmp_path: Any) -> Iterator[dict[str, Any]]:
    node, pod, up = make_netns("node"), make_netns("pod"), make_netns("up")
    run(
        "ip",
        "link",
        "add",
        "vp",
        "netns",
        node.name,
        "type",
        "veth",
        "peer",
        "vpp",
        "netns",
        pod.name,
    )
    run(
        "ip",
        "link",
        "add",
        "vu",
        "netns",
        node.name,
        "type",
        "veth",
        "peer",
        "vuu",
        "netns",
        up.name,
    )
    for ns, cmds in (
        (
            node,
            [
                "addr add 169.254.0.53/32 dev vp",
                "link set vp up",
                "route add 169.254.16.0/24 dev vp",
                "addr add 10.53.0.1/24 dev vu",
                "addr add fd53::1/64 dev vu nodad",
                "link set vu up",
            ],
        ),
        (
            pod,
            [
                f"addr add {POD_IP}/32 dev vpp",
                f"addr add {STRANGER_IP}/32 dev vpp",
                "link set vpp up",
                "route add 169.254.0.53/32 dev vpp",
            ],
        ),
        (up, [f"addr add {UP4}/24 dev vuu", f"addr add {UP6}/64 dev vuu nodad", "link set vuu up"]),
    ):
        for cmd in cmds:
            ns.run("ip", *cmd.split())
    dnsmasq = up.popen(
        "dnsmasq",
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        f"--listen-address={UP4}",
        f"--listen-address={UP6}",
        "--port=53",
        "--user=root",
        f"--pid-file={tmp_path}/dnsmasq.pid",
        "--address=/example.test/192.0.2.7",
        "--address=/example.test/2001:db8::7",
        "--local-ttl=300",
        f"--dns-rr=svc.example.test,65,{ech_https_hex()}",
        f"--log-facility={tmp_path}/dnsmasq.log",
        "--log-queries",
    )
    try:
        for _ in range(50):
            if (
                up.run(
                    "dig", f"@{UP4}", "x.example.test", "+short", "+time=1", "+tries=1", check=False
                ).stdout.strip()
                == "192.0.2.7"
            ):
                break
        yield {"node": node, "pod": pod, "up": up, "log": tmp_path / "dnsmasq.log"}
    finally:
        dnsmasq.terminate()
        dnsmasq.wait(5)


class Harness:
    def __init__(
        self,
        topo: dict[str, Any],
        pods: dict[str, PodDns],
        cache: bool = False,
        udp_batching: bool = True,
    ) -> None:
        self.topo = topo
        self.pods = pods
        self.records: list[QueryRecord] = []
        self.tables = {
            "web": NameTable.parse("web", 1, {"db": ["2001:db8::5", "10.1.0.5"]}, ("common",)),
            "common": NameTable.parse("common", 1, {"cache": ["127.0.0.1"]}),
        }
        with in_netns(topo["node"]):
            self.sockets = bind_dns_sockets(RESOLVER)

        def factory(family: int, kind: int) -> socket.socket:
            with in_netns(topo["node"]):
                return socket.socket(family, kind)

        self.server = DnsServer(
            self.sockets,
            pod_for=lambda a: self.pods.get(str(a)),
            name_tables=lambda: self.tables,
            on_record=self.records.append,
            default_upstreams=(ipaddress.ip_address(UP6),),
            upstream_timeout=0.5,
            socket_factory=factory,
            cache=AnswerCache() if cache else None,
            udp_batching=udp_batching,
        )

    async def dig(self, *args: str, source: str = POD_IP) -> str:
        argv = [
            "ip",
            "netns",
            "exec",
            self.topo["pod"].name,
            "dig",
            "@169.254.0.53",
            "-b",
            source,
            "+tries=1",
            "+time=3",
            *args,
        ]
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        return str(done.stdout.decode())

    def pod_socket(self, kind: int, source: str = POD_IP) -> socket.socket:
        with in_netns(self.topo["pod"]):
            sock = socket.socket(socket.AF_INET, kind)
        sock.bind((source, 0))
        return sock


@contextlib.asynccontextmanager
async def serving(h: Harness, loaded: bool = True) -> AsyncIterator[Harness]:
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(h.server.serve)
            if loaded:
                h.server.pods_loaded()
            yield h
            nursery.cancel_scope.cancel()
    finally:
        h.sockets.close()


@pytest.fixture
async def harness(topology: dict[str, Any]) -> AsyncIterator[Harness]:
    async with serving(Harness(topology, {POD_IP: PodDns("a1b2c3d4e5f", ("web",), ())})) as h:
        yield h


def status(out: str) -> str:
    return out.split("status: ")[1].split(",")[0] if "status: " in out else "no answer: " + out


async def test_names_of_the_pods_tables_are_answered_with_authority(harness: Harness) -> None:
    out = await harness.dig("DB", "AAAA")
    assert status(out) == "NOERROR"
    assert " aa " in out.split("flags:")[1].split(";")[0] + " "
    assert "DB.\t\t\t5\tIN\tAAAA\t2001:db8::5" in out
    out = await harness.dig("db", "A")
    assert "5\tIN\tA\t10.1.0.5" in out
    out = await harness.dig("cache", "A", "+short")
    assert out.strip() == "127.0.0.1"
    out = await harness.dig("db", "MX")
    assert status(out) == "NOERROR"
    assert "ANSWER: 0" in out
    rec = harness.records[0]
    assert (rec.pod, rec.name, rec.qtype, rec.rcode, rec.upstream) == (
        "a1b2c3d4e5f",
        "DB.",
        28,
        0,
        None,
    )
    assert rec.answers == ("AAAA 2001:db8::5",)
    assert harness.server.counters.authoritative == 4
    # None of it reached the upstream.
    asked = [line for line in harness.topo["log"].read_text().splitlines() if "query[" in line]
    assert not [line for line in asked if " db " in line.lower() or " cache " in line]


async def test_strangers_are_refused(harness: Harness) -> None:
    out = await harness.dig("db", "A", source=STRANGER_IP)
    assert status(out) == "REFUSED"
    assert harness.server.counters.refused == 1
    assert harness.records[-1].pod is None
    assert harness.records[-1].source == STRANGER_IP


async def test_other_names_are_forwarded_and_recorded(harness: Harness) -> None:
    out = await harness.dig("www.example.test", "AAAA", "+short")
    assert out.strip() == "2001:db8::7"
    rec = harness.records[-1]
    assert (rec.name, rec.upstream, rec.answers) == (
        "www.example.test.",
        UP6,
        ("AAAA 2001:db8::7",),
    )
    out = await harness.dig("nothing.invalid", "A")
    direct = harness.topo["up"].run("dig", f"@{UP4}", "nothing.invalid", "A").stdout
    assert status(out) == status(direct) == "REFUSED"  # dnsmasq with no upstream: passed as given


async def test_pod_upstreams_are_asked_in_order_past_one_that_is_silent(harness: Harness) -> None:
    harness.pods[POD_IP] = PodDns(
        "a1b2c3d4e5f", ("web",), tuple(map(ipaddress.ip_address, (DEAD4, UP4)))
    )
    out = await harness.dig("www.example.test", "A", "+short")
    assert out.strip() == "192.0.2.7"
    assert harness.records[-1].upstream == UP4
    assert harness.server.counters.upstream_timeouts == 1


async def test_https_records_arrive_without_ech(harness: Harness) -> None:
    direct = harness.topo["up"].run("dig", f"@{UP4}", "svc.example.test", "TYPE65", "+short").stdout
    assert direct.strip()  # the upstream does serve ech (key 5)
    sock = trio.socket.from_stdlib_socket(harness.pod_socket(socket.SOCK_DGRAM))
    query = m.build_message(
        m.Message(7, m.RD, (m.Question(m.name_from_text("svc.example.test"), m.HTTPS),))
    )
    raw = bytes.fromhex(direct.split()[-1]) if "\\#" in direct else None
    if raw is not None:
        assert any(k == m.SVC_ECH for k, _ in m.parse_svcb(raw).params)
    await sock.sendto(query, (str(RESOLVER), 53))
    with trio.fail_after(5):
        answer = m.parse_message(await sock.recv(4096))
    assert answer.id == 7
    (https,) = [a for a in answer.answers if a.rtype == m.HTTPS]
    keys = [k for k, _ in m.parse_svcb(https.rdata).params]
    assert keys == [1, 4]
    out = await harness.dig("svc.example.test", "HTTPS")
    assert "alpn" in out
    assert "ech" not in out.split("ANSWER SECTION:")[1]
    sock.close()


async def test_tcp_queries_and_pipelining(harness: Harness) -> None:
    out = await harness.dig("+tcp", "www.example.test", "A", "+short")
    assert out.strip() == "192.0.2.7"
    sock = trio.socket.from_stdlib_socket(harness.pod_socket(socket.SOCK_STREAM))
    await sock.connect((str(RESOLVER), 53))
    queries = [
        m.build_message(m.Message(i, m.RD, (m.Question((b"db",), qt),)))
        for i, qt in ((1, m.A), (2, m.AAAA))
    ]
    await sock.send(b"".join(len(q).to_bytes(2, "big") + q for q in queries))
    got = {}
    with trio.fail_after(5):
        buf = b""
        while len(got) < 2:
            buf += await sock.recv(4096)
            while len(buf) >= 2 and len(buf) >= 2 + int.from_bytes(buf[:2], "big"):
                n = int.from_bytes(buf[:2], "big")
                msg = m.parse_message(buf[2 : 2 + n])
                got[msg.id] = msg
                buf = buf[2 + n :]
    assert got[1].answers[0].rdata == bytes([10, 1, 0, 5])
    assert len(got[2].answers[0].rdata) == 16
    assert harness.server.counters.tcp_queries >= 3
    sock.close()


async def test_malformed_and_oversized_input_is_counted_and_survived(harness: Harness) -> None:
    udp = trio.socket.from_stdlib_socket(harness.pod_socket(socket.SOCK_DGRAM))
    await udp.sendto(
        b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x09garbage", (str(RESOLVER), 53)
    )
    with trio.fail_after(5):
        formerr = m.parse_message(await udp.recv(512))
    assert (formerr.id, formerr.rcode) == (0xABCD, m.FORMERR)
    await udp.sendto(b"\x01\x02\x03", (str(RESOLVER), 53))
    tcp = trio.socket.from_stdlib_socket(harness.pod_socket(socket.SOCK_STREAM))
    await tcp.connect((str(RESOLVER), 53))
    await tcp.send(struct.pack("!H", 65535) + b"\0" * 100)
    with trio.fail_after(5):
        with contextlib.suppress(ConnectionResetError):  # unread bytes make the close a reset
            while await tcp.recv(100):
                pass
    counters = harness.server.counters
    assert counters.malformed == 2
    assert counters.oversized == 1
    out = await harness.dig("db", "A", "+short")
    assert out.strip() == "10.1.0.5"  # and it answers on
    udp.close()
    tcp.close()


async def test_queries_wait_until_the_pods_are_loaded(topology: dict[str, Any]) -> None:
    h = Harness(topology, {POD_IP: PodDns("a1b2c3d4e5f", ("web",), ())})
    with trio.socket.from_stdlib_socket(h.pod_socket(socket.SOCK_DGRAM)) as sock:
        query = m.build_message(m.Message(3, m.RD, (m.Question((b"db",), m.A),)))
        await sock.sendto(query, (str(RESOLVER), 53))
        async with serving(h, loaded=False):
            with trio.move_on_after(0.5) as early:
                await sock.recv(512)
            assert early.cancelled_caught
            h.server.pods_loaded()
            with trio.fail_after(5):
                answer = m.parse_message(await sock.recv(512))
    assert (answer.id, answer.rcode, answer.answers[0].rdata) == (3, 0, bytes([10, 1, 0, 5]))


async def test_the_cache_answers_again_with_lower_ttls(topology: dict[str, Any]) -> None:
    async with serving(Harness(topology, {POD_IP: PodDns("a1b2c3d4e5f", (), ())}, cache=True)) as h:
        await check_cache(h)


async def check_cache(h: Harness) -> None:
    first = await h.dig("www.example.test", "AAAA")
    assert "2001:db8::7" in first
    await trio.sleep(1.1)
    second = await h.dig("www.example.test", "AAAA")
    ttl = lambda out: int(out.split("ANSWER SECTION:")[1].split()[1])  # noqa: E731
    assert ttl(second) < ttl(first)
    assert h.server.counters.cache_hits == 1
    assert h.records[-1].cached


async def test_the_loop_without_batching_answers_alike(topology: dict[str, Any]) -> None:
    # recvfrom/sendto, where libc lacks recvmmsg: the same answers, records and counts.
    pods = {POD_IP: PodDns("a1b2c3d4e5f", ("web",), ())}
    async with serving(Harness(topology, pods, cache=True, udp_batching=False)) as h:
        await check_cache(h)
        assert (await h.dig("db", "A", "+short")).strip() == "10.1.0.5"
        assert status(await h.dig("db", "A", source=STRANGER_IP)) == "REFUSED"
        udp = trio.socket.from_stdlib_socket(h.pod_socket(socket.SOCK_DGRAM))
        await udp.sendto(b"\x01\x02\x03", (str(RESOLVER), 53))
        await udp.sendto(
            b"\xab\xcd\x01\x00\x00\x01" + bytes(6) + b"\x09garbage", (str(RESOLVER), 53)
        )
        with trio.fail_after(5):
            assert m.parse_message(await udp.recv(512)).rcode == m.FORMERR
        udp.close()
        counters = h.server.counters
        assert (counters.udp_queries, counters.malformed, counters.refused) == (6, 2, 1)
        assert [r.cached for r in h.records] == [False, True, False, False, False]
