"""Records: naming the pods, the grace of a pod that left, the hub's missed counts."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct

import pytest
import trio

from feos.net import _traffic_netlink as nl
from feos.net._traffic import (
    DnsQuery,
    PodDirectory,
    RecordHub,
    ServerNames,
    flow_record,
)

POD4 = ipaddress.IPv4Address("169.254.16.1")
DNS = ipaddress.IPv4Address("169.254.0.53")


def _event(src: str, dst: str, dport: int, kind: str = "destroy") -> nl.CtEvent:
    t = nl.Tuple(ipaddress.ip_address(src), ipaddress.ip_address(dst), 17, 5000, dport)
    r = nl.Tuple(t.dst, ipaddress.ip_address("192.0.2.9"), 17, dport, 5000)
    return nl.CtEvent(kind, 2, t, r, 1, 60, 1, 90, 2 * 10**9, 3 * 10**9, 1, b"", None)


def test_departed_pod_named_for_five_minutes() -> None:
    now = [1000.0]
    pods = PodDirectory(clock=lambda: now[0])
    pods.add("a", [POD4], "pod-aaaaaaaaaaa", 7)
    assert pods.by_ifindex(7) == "a"
    pods.remove("a")
    assert pods.by_address(POD4) == "a"
    assert pods.by_tap("pod-aaaaaaaaaaa") is None
    assert pods.by_ifindex(7) is None
    now[0] += 299
    assert pods.by_address(POD4) == "a"
    now[0] += 2
    assert pods.by_address(POD4) is None
    pods.add("b", [POD4])
    pods.remove("b")
    pods.add("c", [POD4])  # another holds it: the one that left lets go at once
    assert pods.by_address(POD4) == "c"


def test_flow_naming() -> None:
    pods = PodDirectory()
    pods.add("a", [POD4])
    pods.resolver.add(DNS)
    f = flow_record(_event("169.254.16.1", "1.1.1.1", 443), pods)
    assert f is not None
    assert (f.pod_id, f.bytes_out, f.bytes_in, f.start, f.end) == ("a", 60, 90, 2.0, 3.0)
    assert flow_record(_event("169.254.16.1", str(DNS), 53), pods) is None  # DNS records have it
    assert flow_record(_event("10.0.0.1", "1.1.1.1", 443), pods) is None  # not a pod's
    assert flow_record(_event("169.254.16.1", "1.1.1.1", 443, "new"), pods) is None
    inbound = flow_record(_event("2001:db8::9", "169.254.16.1", 80), pods)
    assert inbound is not None
    assert inbound.pod_id == "a"


def _q(n: int) -> DnsQuery:
    return DnsQuery("a", f"n{n}.test", "A", "NOERROR", (), float(n))


async def test_hub_counts_missed_per_watcher() -> None:
    hub = RecordHub(capacity=3)
    with trio.fail_after(5), hub.subscribe() as slow, hub.subscribe() as fast:
        for i in range(3):
            hub.publish(_q(i))
        assert [(await fast.receive()).missed for _ in range(3)] == [0, 0, 0]
        for i in range(3, 6):
            hub.publish(_q(i))  # slow is full: 3, 4 and 5 are lost to it
        assert [(await fast.receive()).name for _ in range(3)] == ["n3.test", "n4.test",
                                                                   "n5.test"]
        assert [(await slow.receive()).missed for _ in range(3)] == [0, 0, 0]
        hub.publish(_q(6))
        got = await slow.receive()
        assert (got.name, got.missed) == ("n6.test", 3)
        assert (await fast.receive()).missed == 0
        hub.count_lost(4)  # the kernel dropped some on the way
        hub.publish(_q(7))
        assert (await slow.receive()).missed == 4
        assert (await fast.receive()).missed == 4
    hub.publish(_q(8))  # the hub forgets watchers that left
    assert not hub._subs


def _hello(name: str) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _ipv4_tcp(payload: bytes, seq: int) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 40000, 443, seq, 0, 5 << 4, 0x18, 65535, 0, 0) + payload
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0,
                       POD4.packed, socket.inet_aton("1.2.3.4")) + tcp


def test_server_names_reassemble_across_packets() -> None:
    HELLO = _hello("api.example.test")
    pods = PodDirectory()
    pods.add("a", [POD4])
    names = ServerNames()
    first, second = HELLO[:40], HELLO[40:]

    def logged(payload: bytes, seq: int) -> nl.LoggedPacket:
        return nl.LoggedPacket(3, 2, "", 0, 0, 5.0, _ipv4_tcp(payload, seq=seq))

    assert names.feed(logged(first, 100), pods) is None
    got = names.feed(logged(second, 140), pods)
    assert got is not None
    assert (got.pod_id, got.kind, got.name, got.dport, got.time) == ("a", "tls",
                                                                     "api.example.test", 443, 5.0)
