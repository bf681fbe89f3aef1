"""nfnetlink, pure: the messages of ctnetlink (conntrack events, dumps, deletes) and nflog
(NFNL_SUBSYS_ULOG: its configuration and the packets it copies), encoded and decoded without
sockets. pyroute2 has no nflog and its conntrack socket is tied to its thread; the collectors
(feos.net._traffic) read raw netlink sockets and hand the bytes to these functions.

Every decoder takes bytes from the kernel and must not crash on any of them: a message or an
attribute that does not parse is skipped.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterator

import attrs

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
NFNL_SUBSYS_ULOG = 4
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_DESTROY = 1, 3
NFULNL_MSG_PACKET, NFULNL_MSG_CONFIG = 0, 1
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_CREATE, NLM_F_EXCL = 0x400, 0x200
NLA_F_NESTED = 0x8000

# ctnetlink attributes
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS = 1, 2, 3
CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_ID, CTA_ZONE, CTA_TIMESTAMP = 9, 10, 12, 18, 20
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES = 1, 2
CTA_TIMESTAMP_START, CTA_TIMESTAMP_STOP = 1, 2

# nflog attributes
NFULA_PACKET_HDR, NFULA_TIMESTAMP, NFULA_IFINDEX_INDEV, NFULA_IFINDEX_OUTDEV = 1, 3, 4, 5
NFULA_PAYLOAD, NFULA_PREFIX = 9, 10
NFULA_CFG_CMD, NFULA_CFG_MODE = 1, 2
NFULNL_CFG_CMD_BIND, NFULNL_CFG_CMD_PF_BIND = 1, 3
NFULNL_COPY_PACKET = 2

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


# --- framing --------------------------------------------------------------------------------


@attrs.frozen
class Message:
    type: int
    flags: int
    seq: int
    family: int  # nfgenmsg's
    res_id: int
    attrs: bytes  # the attributes after the nfgenmsg
    raw: bytes  # the whole payload after the netlink header (an NLMSG_ERROR's errno is here)


def messages(data: bytes) -> Iterator[Message]:
    off = 0
    while off + 16 <= len(data):
        length, mtype, flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
        if length < 16 or off + length > len(data):
            return
        body = data[off + 16 : off + length]
        if len(body) >= 4:
            family, _version, res_id = struct.unpack_from("!BBH", body)
        else:
            family, res_id = 0, 0
        yield Message(mtype, flags, seq, family, res_id, body[4:], body)
        off += (length + 3) & ~3


def attributes(data: bytes) -> dict[int, bytes]:
    """The attributes of one level, by type (the nested flag cleared); the last one wins."""
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        length, atype = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > len(data):
            break
        out[atype & ~NLA_F_NESTED & 0x7FFF] = data[off + 4 : off + length]
        off += (length + 3) & ~3
    return out


def attribute(atype: int, value: bytes, *, nested: bool = False) -> bytes:
    head = struct.pack("=HH", 4 + len(value), atype | (NLA_F_NESTED if nested else 0))
    return head + value + b"\0" * ((-len(value)) % 4)


def request(subsys: int, msg: int, flags: int, seq: int, family: int, res_id: int,
            attrs_: bytes = b"") -> bytes:
    body = struct.pack("!BBH", family, 0, res_id) + attrs_
    return struct.pack("=IHHII", 16 + len(body), (subsys << 8) | msg, flags, seq, 0) + body


def error_code(msg: Message) -> int:
    """An NLMSG_ERROR's errno (0 for an ACK)."""
    return -struct.unpack_from("=i", msg.raw)[0] if len(msg.raw) >= 4 else 0


def _u(fmt: str, data: bytes | None, default: int = 0) -> int:
    if data is None or len(data) < struct.calcsize(fmt):
        return default
    return int(struct.unpack_from(fmt, data)[0])


# --- conntrack ------------------------------------------------------------------------------


@attrs.frozen
class Tuple:
    src: Address
    dst: Address
    protocol: int
    sport: int
    dport: int


@attrs.frozen
class CtEvent:
    """A conntrack entry as an event or a dump gives it."""

    kind: str  # "new", "update", "destroy"
    family: int
    orig: Tuple
    reply: Tuple | None
    packets_orig: int
    bytes_orig: int
    packets_reply: int
    bytes_reply: int
    start_ns: int  # 0 without nf_conntrack_timestamp
    stop_ns: int
    id: int
    orig_raw: bytes  # CTA_TUPLE_ORIG as sent, for a delete that names the same entry
    zone: bytes | None


def _tuple(data: bytes) -> Tuple | None:
    a = attributes(data)
    ip = attributes(a.get(CTA_TUPLE_IP, b""))
    proto = attributes(a.get(CTA_TUPLE_PROTO, b""))
    try:
        if CTA_IP_V4_SRC in ip:
            src: Address = ipaddress.IPv4Address(ip[CTA_IP_V4_SRC])
            dst: Address = ipaddress.IPv4Address(ip[CTA_IP_V4_DST])
        else:
            src = ipaddress.IPv6Address(ip[CTA_IP_V6_SRC])
            dst = ipaddress.IPv6Address(ip[CTA_IP_V6_DST])
    except (KeyError, ValueError):
        return None
    return Tuple(src, dst, _u("B", proto.get(CTA_PROTO_NUM)),
                 _u("!H", proto.get(CTA_PROTO_SRC_PORT)), _u("!H", proto.get(CTA_PROTO_DST_PORT)))


def decode_conntrack(msg: Message) -> CtEvent | None:
    """A ctnetlink NEW or DELETE message as an event; None for anything else."""
    if msg.type >> 8 != NFNL_SUBSYS_CTNETLINK:
        return None
    sub = msg.type & 0xFF
    if sub == IPCTNL_MSG_CT_DELETE:
        kind = "destroy"
    elif sub == IPCTNL_MSG_CT_NEW:
        kind = "new" if msg.flags & (NLM_F_CREATE | NLM_F_EXCL) else "update"
    else:
        return None
    a = attributes(msg.attrs)
    orig = _tuple(a.get(CTA_TUPLE_ORIG, b""))
    if orig is None:
        return None
    co, cr = attributes(a.get(CTA_COUNTERS_ORIG, b"")), attributes(a.get(CTA_COUNTERS_REPLY, b""))
    ts = attributes(a.get(CTA_TIMESTAMP, b""))
    return CtEvent(kind, msg.family, orig, _tuple(a.get(CTA_TUPLE_REPLY, b"")),
                   _u("!Q", co.get(CTA_COUNTERS_PACKETS)), _u("!Q", co.get(CTA_COUNTERS_BYTES)),
                   _u("!Q", cr.get(CTA_COUNTERS_PACKETS)), _u("!Q", cr.get(CTA_COUNTERS_BYTES)),
                   _u("!Q", ts.get(CTA_TIMESTAMP_START)), _u("!Q", ts.get(CTA_TIMESTAMP_STOP)),
                   _u("!I", a.get(CTA_ID)), a[CTA_TUPLE_ORIG], a.get(CTA_ZONE))


def conntrack_dump(seq: int, family: int = socket.AF_UNSPEC) -> bytes:
    return request(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, seq,
                   family, 0)


def conntrack_delete(event: CtEvent, seq: int) -> bytes:
    """Delete the entry the event names: its original tuple, its zone and its ID."""
    body = attribute(CTA_TUPLE_ORIG, event.orig_raw, nested=True)
    if event.zone is not None:
        body += attribute(CTA_ZONE, event.zone)
    if event.id:
        body += attribute(CTA_ID, struct.pack("!I", event.id))
    return request(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, seq,
                   event.family, 0, body)


# --- nflog ----------------------------------------------------------------------------------


def nflog_config(seq: int, group: int, command: int | None = None, family: int = 0,
                 copy_range: int | None = None) -> bytes:
    """A NFULNL_MSG_CONFIG: a command (bind) and/or the copy mode, acknowledged."""
    body = b""
    if command is not None:
        body += attribute(NFULA_CFG_CMD, struct.pack("B", command))
    if copy_range is not None:
        body += attribute(NFULA_CFG_MODE, struct.pack("!IBx", copy_range, NFULNL_COPY_PACKET))
    return request(NFNL_SUBSYS_ULOG, NFULNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, family,
                   group, body)


@attrs.frozen
class LoggedPacket:
    group: int
    family: int
    prefix: str
    indev: int
    outdev: int
    timestamp: float | None
    payload: bytes  # the packet from its network header on


def decode_nflog(msg: Message) -> LoggedPacket | None:
    if msg.type != (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
        return None
    a = attributes(msg.attrs)
    prefix = a.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode("utf-8", "replace")
    ts = a.get(NFULA_TIMESTAMP)
    when = None
    if ts is not None and len(ts) >= 16:
        sec, usec = struct.unpack_from("!QQ", ts)
        when = sec + usec / 1e6
    return LoggedPacket(msg.res_id, msg.family, prefix, _u("!I", a.get(NFULA_IFINDEX_INDEV)),
                        _u("!I", a.get(NFULA_IFINDEX_OUTDEV)), when, a.get(NFULA_PAYLOAD, b""))
