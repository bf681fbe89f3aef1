"""The traffic parsers on outside input: SNI at any cut point, HTTP Host, IP packets, nfnetlink."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net import _traffic_netlink as nl
from feos.net._traffic_parse import (
    NEED_MORE,
    http_host,
    parse_drop_prefix,
    parse_packet,
    tls_server_name,
)


def client_hello(name: str) -> bytes:
    """A real ClientHello, as Python's ssl (OpenSSL) writes it."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


HELLO = client_hello("api.Example.test")


def test_sni_of_a_real_hello() -> None:
    assert tls_server_name(HELLO) == "api.example.test"
    assert tls_server_name(HELLO + b"trailing") == "api.example.test"


def test_sni_at_every_cut_point() -> None:
    for cut in range(len(HELLO)):
        got = tls_server_name(HELLO[:cut])
        assert got in (NEED_MORE, "api.example.test", None), cut
        if 0 < cut < 60:
            assert got == NEED_MORE, cut


def test_not_tls() -> None:
    assert tls_server_name(b"GET / HTTP/1.1\r\n") is None
    assert tls_server_name(b"") is None
    assert tls_server_name(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00") is None  # ServerHello


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_sni_fuzz(data: bytes) -> None:
    out = tls_server_name(data)
    assert out is None or isinstance(out, str)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(HELLO)), st.integers(0, 255), st.integers(0, len(HELLO) - 1))
def test_sni_mutated_hello(cut: int, byte: int, where: int) -> None:
    data = bytearray(HELLO[:cut] if cut else HELLO)
    if where < len(data):
        data[where] = byte
    out = tls_server_name(bytes(data))
    assert out is None or isinstance(out, str)


def test_http_host() -> None:
    assert http_host(b"GET / HTTP/1.1\r\nHost: Web.Example.test:8080\r\n\r\n") == "web.example.test"
    assert http_host(b"POST /x HTTP/1.1\r\nhost:  a.b\r\nX: y\r\n\r\n") == "a.b"
    assert http_host(b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n") == "2001:db8::1"
    assert http_host(b"GET / HTTP/1.1\r\nUser-Agent: x\r\n") == NEED_MORE
    assert http_host(b"GE") == NEED_MORE
    assert http_host(b"GET / HTTP/1.1\r\n\r\n") is None
    assert http_host(b"\x16\x03\x01") is None
    assert http_host(b"GET / HTTP/1.1\r\nHost: bad host\r\n\r\n") is None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_http_host_fuzz(data: bytes) -> None:
    for d in (data, b"GET / HTTP/1.1\r\n" + data):
        out = http_host(d)
        assert out is None or isinstance(out, str)


def _ipv4_tcp(payload: bytes, sport: int = 40000, dport: int = 443, seq: int = 7) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x18, 65535, 0, 0) + payload
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0,
                       socket.inet_aton("169.254.16.1"), socket.inet_aton("1.2.3.4"))
    return head + tcp


def test_packets() -> None:
    p = parse_packet(_ipv4_tcp(b"hello"))
    assert p is not None
    assert (p.family, str(p.src), str(p.dst), p.protocol, p.sport, p.dport, p.seq, p.payload) == (
        4, "169.254.16.1", "1.2.3.4", 6, 40000, 443, 7, b"hello")
    udp = struct.pack("!HHHH", 5353, 53, 12, 0) + b"dnsq"
    v6 = struct.pack("!IHBB16s16s", 6 << 28, len(udp), 17, 64,
                     ipaddress.IPv6Address("2001:db8::2").packed,
                     ipaddress.IPv6Address("2001:db8::53").packed) + udp
    q = parse_packet(v6)
    assert q is not None
    assert (q.family, q.protocol, q.sport, q.dport, q.payload) == (6, 17, 5353, 53, b"dnsq")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_packet_fuzz(data: bytes) -> None:
    parse_packet(data)
    parse_packet(b"\x45" + data)
    parse_packet(b"\x60" + data)


def test_drop_prefix() -> None:
    d = parse_drop_prefix("deny pod-abcdefghjkm")
    assert (d.reason, d.tap) == ("deny", "pod-abcdefghjkm")
    d = parse_drop_prefix("no-rule:pod-22222222 ")
    assert (d.reason, d.tap) == ("no-rule", "pod-22222222")
    assert parse_drop_prefix("spoofed").tap is None
    d = parse_drop_prefix("feos:no-rule:pod-abcdefghjkm")  # as feos.net._nft logs them
    assert (d.reason, d.tap) == ("no-rule", "pod-abcdefghjkm")
    d = parse_drop_prefix("feos:input")
    assert (d.reason, d.tap) == ("input", None)
    assert parse_drop_prefix("").reason == "unknown"


def _nlattr(t: int, v: bytes, nested: bool = False) -> bytes:
    return nl.attribute(t, v, nested=nested)


def _ct_destroy(src: str, dst: str) -> bytes:
    ip = _nlattr(nl.CTA_IP_V4_SRC, socket.inet_aton(src)) + _nlattr(
        nl.CTA_IP_V4_DST, socket.inet_aton(dst))
    proto = (_nlattr(nl.CTA_PROTO_NUM, b"\x06") + _nlattr(nl.CTA_PROTO_SRC_PORT, b"\x9c\x40")
             + _nlattr(nl.CTA_PROTO_DST_PORT, b"\x01\xbb"))
    tup = _nlattr(nl.CTA_TUPLE_IP, ip, True) + _nlattr(nl.CTA_TUPLE_PROTO, proto, True)
    counters = (_nlattr(nl.CTA_COUNTERS_PACKETS, struct.pack("!Q", 5))
                + _nlattr(nl.CTA_COUNTERS_BYTES, struct.pack("!Q", 900)))
    ts = (_nlattr(nl.CTA_TIMESTAMP_START, struct.pack("!Q", 10**18))
          + _nlattr(nl.CTA_TIMESTAMP_STOP, struct.pack("!Q", 10**18 + 10**9)))
    body = (_nlattr(nl.CTA_TUPLE_ORIG, tup, True) + _nlattr(nl.CTA_COUNTERS_ORIG, counters, True)
            + _nlattr(nl.CTA_TIMESTAMP, ts, True) + _nlattr(nl.CTA_ID, struct.pack("!I", 77)))
    return nl.request(nl.NFNL_SUBSYS_CTNETLINK, nl.IPCTNL_MSG_CT_DELETE, 0, 0, 2, 0, body)


def test_conntrack_decode_and_delete_roundtrip() -> None:
    (m,) = list(nl.messages(_ct_destroy("169.254.16.1", "1.2.3.4")))
    ev = nl.decode_conntrack(m)
    assert ev is not None
    assert ev.kind == "destroy"
    assert (str(ev.orig.src), str(ev.orig.dst), ev.orig.protocol, ev.orig.sport,
            ev.orig.dport) == ("169.254.16.1", "1.2.3.4", 6, 40000, 443)
    assert (ev.packets_orig, ev.bytes_orig, ev.id) == (5, 900, 77)
    assert ev.stop_ns - ev.start_ns == 10**9
    (d,) = list(nl.messages(nl.conntrack_delete(ev, 9)))
    a = nl.attributes(d.attrs)
    assert a[nl.CTA_TUPLE_ORIG] == ev.orig_raw
    assert d.type == (nl.NFNL_SUBSYS_CTNETLINK << 8) | nl.IPCTNL_MSG_CT_DELETE


def test_nflog_decode() -> None:
    body = (_nlattr(nl.NFULA_PREFIX, b"deny pod-abcdefghjkm\0")
            + _nlattr(nl.NFULA_IFINDEX_INDEV, struct.pack("!I", 3))
            + _nlattr(nl.NFULA_TIMESTAMP, struct.pack("!QQ", 100, 500000))
            + _nlattr(nl.NFULA_PAYLOAD, b"\x45abc"))
    raw = nl.request(nl.NFNL_SUBSYS_ULOG, nl.NFULNL_MSG_PACKET, 0, 0, 2, 2, body)
    (m,) = list(nl.messages(raw))
    p = nl.decode_nflog(m)
    assert p is not None
    assert (p.group, p.prefix, p.indev, p.timestamp, p.payload) == (
        2, "deny pod-abcdefghjkm", 3, 100.5, b"\x45abc")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_netlink_fuzz(data: bytes) -> None:
    framed = struct.pack("=IHHII", 16 + len(data), 0x102, 0, 0, 0) + data
    for raw in (data, framed, struct.pack("=IHHII", 16 + len(data), 0x400, 0, 0, 0) + data):
        for m in nl.messages(raw):
            nl.decode_conntrack(m)
            nl.decode_nflog(m)
            nl.error_code(m)
