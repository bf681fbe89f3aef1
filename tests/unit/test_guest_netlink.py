"""The guest's rtnetlink messages: what they say, and how the kernel's answers are read."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.guest import _netlink as nl
from feos.guest import _system
from feos.guest._system import Flush, Step

V4, V6 = socket.AF_INET, socket.AF_INET6


def datagram(*msgs: bytes) -> bytes:
    return b"".join(m + bytes(nl.align(len(m)) - len(m)) for m in msgs)


def error_msg(seq: int, err: int, *, request: bytes = b"", text: str = "", capped: bool = True,
              mtype: int = nl.NLMSG_ERROR) -> bytes:  # fmt: skip
    """An NLMSG_ERROR as the kernel writes it: the request's header (and body unless capped),
    then, with a text, the extended-ack TLVs."""
    echoed = nl.message(nl.RTM_NEWADDR, nl.NLM_F_REQUEST, seq, request)
    body = struct.pack("=i", -err) + (echoed[: nl.HDR.size] if capped else datagram(echoed))
    flags = nl.NLM_F_CAPPED if capped else 0
    if text:
        body += nl.attr(nl.NLMSGERR_ATTR_MSG, text.encode() + b"\0")
        flags |= nl.NLM_F_ACK_TLVS
    return nl.message(mtype, flags, seq, body)


# Building ------------------------------------------------------------------------------------


def test_a_message_and_its_attributes_are_the_kernels_layout() -> None:
    up = nl.message(nl.RTM_NEWLINK, nl.NLM_F_REQUEST | nl.NLM_F_ACK, 7, nl.link_up(3, 1420))
    assert len(up) == 16 + 16 + 8
    assert struct.unpack_from("=IHHII", up) == (40, 16, 5, 7, 0)
    assert struct.unpack_from("=BxHiII", up, 16) == (0, 0, 3, 1, 1)
    assert up[32:] == struct.pack("=HHI", 8, nl.IFLA_MTU, 1420)
    assert nl.link_up(1) == struct.pack("=BxHiII", 0, 0, 1, 1, 1)  # no MTU: no attribute
    assert nl.attr(3, b"eth0\0") == struct.pack("=HH", 9, 3) + b"eth0\0" + bytes(3)


def test_an_address_is_local_and_address_with_its_flags() -> None:
    addr = socket.inet_pton(V6, "fd00::5")
    payload = nl.addr_msg(V6, 4, addr, 128, nl.IFA_F_NODAD)
    assert struct.unpack_from("=BBBBI", payload) == (V6, 128, nl.IFA_F_NODAD, 0, 4)
    assert nl.attrs(payload[8:]) == {nl.IFA_LOCAL: addr, nl.IFA_ADDRESS: addr}
    assert nl.read_addr(payload) == nl.Addr(V6, 128, 0, 4)


def route(payload: bytes) -> tuple[tuple[int, ...], dict[int, bytes]]:
    return nl.RTMSG.unpack_from(payload), nl.attrs(payload[nl.RTMSG.size :])


def test_routes_as_ip_sends_them() -> None:
    gw = socket.inet_pton(V6, "fe80::1")
    head, found = route(nl.route_msg(V6, 2, _system.ULA_NET, 7, gateway=gw, mtu=1420))
    assert head == (V6, 7, 0, 0, 254, nl.RTPROT_BOOT, 0, nl.RTN_UNICAST, 0)
    assert found[nl.RTA_DST] == socket.inet_pton(V6, "fc00::")
    assert found[nl.RTA_GATEWAY] == gw and found[nl.RTA_OIF] == struct.pack("=I", 2)
    assert nl.attrs(found[nl.RTA_METRICS]) == {nl.RTAX_MTU: struct.pack("=I", 1420)}
    head, found = route(nl.route_msg(V6, 2, b"", 0, delete=True))  # any default on the device
    assert head == (V6, 0, 0, 0, 254, 0, nl.RT_SCOPE_NOWHERE, 0, 0)
    assert set(found) == {nl.RTA_OIF}
    assert nl.read_route(nl.route_msg(V4, 9, b"", 0, flags=nl.RTNH_F_ONLINK)) == nl.Route(
        V4, 0, 254, 0, nl.RTNH_F_ONLINK, 9
    )


def decoded(plan: list[Step | Flush]) -> list[tuple[str, int, int]]:
    return [(s.name, s.kind if isinstance(s, Step) else s.dump, s.family if isinstance(s, Flush)
             else s.flags) for s in plan]  # fmt: skip


def test_the_plan_of_a_ula_with_ipv4_and_an_mtu() -> None:
    plan = _system.network_plan("eth0", 1, 2, "fd00::5", True, "169.254.16.5", 1420)
    create, replace = nl.NLM_F_CREATE | nl.NLM_F_EXCL, nl.NLM_F_CREATE | nl.NLM_F_REPLACE
    assert decoded(plan) == [
        ("link up lo", nl.RTM_NEWLINK, 0),
        ("link up eth0 mtu 1420", nl.RTM_NEWLINK, 0),
        ("delete the IPv6 default route", nl.RTM_DELROUTE, 0),
        ("delete the fc00::/7 route", nl.RTM_DELROUTE, 0),
        ("flush the global IPv6 addresses", nl.RTM_GETADDR, V6),
        ("flush the IPv4 routes", nl.RTM_GETROUTE, V4),
        ("flush the IPv4 addresses", nl.RTM_GETADDR, V4),
        ("add fd00::5/128", nl.RTM_NEWADDR, create),
        ("route fc00::/7 via fe80::1", nl.RTM_NEWROUTE, replace),
        ("add 169.254.16.5/32", nl.RTM_NEWADDR, create),
        ("route 169.254.0.1 scope link", nl.RTM_NEWROUTE, replace),
        ("route default via 169.254.0.1 onlink", nl.RTM_NEWROUTE, replace),
    ]
    steps = [s for s in plan if isinstance(s, Step)]
    assert [s.missing_ok for s in steps[:4]] == [False, False, True, True]
    assert not any(s.missing_ok for s in steps[4:])
    flushes = [s for s in plan if isinstance(s, Flush)]
    assert [(f.ifindex, f.global_only) for f in flushes] == [(2, True), (2, False), (2, False)]
    assert steps[0].payload == nl.link_up(1) and steps[1].payload == nl.link_up(2, 1420)
    assert nl.read_addr(steps[4].payload) == nl.Addr(V6, 128, 0, 2)
    assert steps[4].payload[2] == nl.IFA_F_NODAD
    head, found = route(steps[5].payload)
    assert head[1] == 7 and nl.attrs(found[nl.RTA_METRICS]) == {2: struct.pack("=I", 1420)}
    assert nl.read_addr(steps[6].payload) == nl.Addr(V4, 32, 0, 2)
    onlink = nl.read_route(steps[7].payload)
    assert (onlink.dst_len, onlink.scope) == (32, nl.RT_SCOPE_LINK)
    assert route(steps[7].payload)[1][nl.RTA_DST] == socket.inet_pton(V4, "169.254.0.1")
    default = nl.read_route(steps[8].payload)
    assert (default.dst_len, default.flags, default.oif) == (0, nl.RTNH_F_ONLINK, 2)


def test_the_plan_of_a_global_address_alone() -> None:
    plan = _system.network_plan("eth0", 1, 3, "2001:db8::5", False, "", 0)
    names = [s.name for s in plan]
    assert names[1] == "link up eth0" and names[-1] == "route default via fe80::1"
    assert not any("169.254" in n for n in names)
    last = plan[-1]
    assert isinstance(last, Step)
    head, found = route(last.payload)
    assert head[1] == 0 and set(found) == {nl.RTA_GATEWAY, nl.RTA_OIF}  # no MTU metric
    assert len(_system.network_plan("eth0", 1, 3, "", False, "", 0)) == 7  # only the flushes
    assert _system.is_ula(bytes([0xFD]) + bytes(15))
    assert not _system.is_ula(bytes([0x20]) + bytes(15))


# Flushes -------------------------------------------------------------------------------------


def dumped(kind: int, payload: bytes) -> nl.Msg:
    return nl.Msg(kind, nl.NLM_F_MULTI, 5, payload)


def test_a_flush_deletes_what_the_dump_said_of_the_device_only() -> None:
    a6 = socket.inet_pton(V6, "2001:db8::1")
    mine_global = nl.IFADDR.pack(V6, 64, 0, 0, 2) + nl.attr(nl.IFA_ADDRESS, a6)
    mine_link = nl.IFADDR.pack(V6, 64, 0, 253, 2) + nl.attr(nl.IFA_ADDRESS, a6)
    other = nl.IFADDR.pack(V6, 64, 0, 0, 3) + nl.attr(nl.IFA_ADDRESS, a6)
    v4 = nl.IFADDR.pack(V4, 24, 0, 0, 2)
    items = [dumped(nl.RTM_NEWADDR, p) for p in (mine_global, mine_link, other, v4)]
    flush6 = Flush("f", nl.RTM_GETADDR, V6, 2, global_only=True)
    assert _system.flush_deletes(flush6, items) == [(nl.RTM_DELADDR, mine_global)]
    flush4 = Flush("f", nl.RTM_GETADDR, V4, 2)
    assert _system.flush_deletes(flush4, items) == [(nl.RTM_DELADDR, v4)]

    def r(table: int, oif: int, flags: int = 0, rta_table: int | None = None) -> bytes:
        head = nl.RTMSG.pack(V4, 24, 0, 0, table, 3, 0, 1, flags) + nl.u32(nl.RTA_OIF, oif)
        return head + (nl.u32(nl.RTA_TABLE, rta_table) if rta_table is not None else b"")

    main, local, elsewhere = r(254, 2), r(255, 2), r(254, 3)
    cloned, big_table_main = r(254, 2, nl.RTM_F_CLONED), r(252, 2, 0, 254)
    routes = [dumped(nl.RTM_NEWROUTE, p) for p in (main, local, elsewhere, cloned, big_table_main)]
    flush = Flush("f", nl.RTM_GETROUTE, V4, 2)
    assert _system.flush_deletes(flush, routes) == [
        (nl.RTM_DELROUTE, main), (nl.RTM_DELROUTE, big_table_main)]  # fmt: skip


# Reading -------------------------------------------------------------------------------------

u16, u32 = st.integers(0, 0xFFFF), st.integers(0, 2**32 - 1)
messages = st.lists(st.tuples(u16, u16, u32, st.binary(max_size=64)), max_size=6)


@given(messages)
def test_parse_reads_back_a_datagram(msgs: list[tuple[int, int, int, bytes]]) -> None:
    raw = datagram(*(nl.message(k, f, s, p) for k, f, s, p in msgs))
    assert nl.parse(raw) == [nl.Msg(k, f, s, p) for k, f, s, p in msgs]


@given(st.binary(max_size=200))
def test_parse_of_any_bytes_is_messages_or_malformed(raw: bytes) -> None:
    try:
        got = nl.parse(raw)
    except nl.Malformed:
        return
    assert sum(nl.align(16 + len(m.payload)) for m in got) >= len(raw) - 3


@given(st.lists(st.tuples(st.integers(0, 0x3FFF), st.binary(max_size=40)), max_size=8))
def test_attrs_read_back(items: list[tuple[int, bytes]]) -> None:
    raw = b"".join(nl.attr(k, v) for k, v in items)
    assert nl.attrs(raw) == dict(items)


@given(st.binary(max_size=100))
def test_attrs_of_any_bytes_are_attributes_or_malformed(raw: bytes) -> None:
    try:
        got = nl.attrs(raw)
    except nl.Malformed:
        return
    assert all(len(v) <= len(raw) for v in got.values())


@given(st.integers(0, 4095), st.text(max_size=40).filter(lambda t: "\0" not in t),
       st.booleans(), st.binary(max_size=30))  # fmt: skip
def test_an_error_or_ack_with_its_text(err: int, text: str, capped: bool, request: bytes) -> None:
    msg = nl.parse(error_msg(9, err, request=request, text=text, capped=capped))[0]
    assert nl.read_error(msg) == (err, text)
    reply = nl.collect(nl.NOTHING, [msg], 9)
    assert reply.done and reply.error == err and reply.text == text


def test_a_short_error_is_malformed() -> None:
    with pytest.raises(nl.Malformed):
        nl.read_error(nl.Msg(nl.NLMSG_ERROR, 0, 1, b"\0" * 8))
    with pytest.raises(nl.Malformed):
        nl.read_route(b"\0" * 4)
    with pytest.raises(nl.Malformed):
        nl.read_route(nl.RTMSG.pack(V4, 0, 0, 0, 254, 0, 0, 0, 0) + nl.attr(nl.RTA_OIF, b"\1"))


@given(st.lists(st.binary(min_size=8, max_size=20), max_size=12), st.integers(1, 5),
       st.booleans(), st.integers(0, 200))  # fmt: skip
def test_a_dump_across_datagrams(payloads: list[bytes], chunk: int, intr: bool, err: int) -> None:
    """Parts of a dump, with strays of another request among them, up to its NLMSG_DONE (which
    carries an error, or the kernel ends it with an NLMSG_ERROR)."""
    seq = 4
    parts = [nl.Msg(nl.RTM_NEWADDR, nl.NLM_F_MULTI, seq, p) for p in payloads]
    if intr and parts:
        parts[-1] = parts[-1]._replace(flags=nl.NLM_F_MULTI | nl.NLM_F_DUMP_INTR)
    stray = nl.Msg(nl.RTM_NEWADDR, nl.NLM_F_MULTI, seq - 1, b"stray...")
    end = nl.Msg(nl.NLMSG_DONE, nl.NLM_F_MULTI, seq, struct.pack("=i", -err))
    stream = [stray, *parts, nl.Msg(nl.NLMSG_NOOP, 0, seq, b""), end, stray]
    reply = nl.NOTHING
    for at in range(0, len(stream), chunk):
        assert not reply.done
        reply = nl.collect(reply, stream[at : at + chunk], seq)
        if reply.done:
            break
    assert reply.done and reply.error == err and reply.text == ""
    assert reply.items == parts and reply.interrupted == (intr and bool(parts))


def test_a_dump_the_kernel_refuses() -> None:
    msg = nl.parse(error_msg(3, errno.EINVAL, text="bad filter"))[0]
    reply = nl.collect(nl.NOTHING, [nl.Msg(nl.RTM_NEWROUTE, nl.NLM_F_MULTI, 3, b"x" * 12), msg], 3)
    assert (reply.done, reply.error, reply.text, len(reply.items)) == (True, 22, "bad filter", 1)


def test_an_error_names_the_step_and_the_errno() -> None:
    text = nl.describe("add fd00::5/128", errno.EEXIST, "")
    assert text == "netlink: add fd00::5/128: File exists (EEXIST)"
    assert nl.describe("x", errno.EACCES, "IPv6 is disabled").endswith("(EACCES): IPv6 is disabled")
