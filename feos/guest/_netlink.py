"""rtnetlink for the guest's network: the messages (pure, struct only) and a blocking socket.

The agent used to run ip(8) for its network; under TCG each process costs tens of milliseconds
and pyroute2's import far more, so the few messages it needs are built and read here. The
layouts are the kernel's (linux/netlink.h, rtnetlink.h, if_addr.h), in host byte order.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from operator import itemgetter

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any, NamedTuple

# nlmsghdr types and flags
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP_INTR = 0x1, 0x2, 0x4, 0x10
NLM_F_DUMP = 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x100, 0x200  # on an NLMSG_ERROR
NLMSGERR_ATTR_MSG = 1
SOL_NETLINK, NETLINK_CAP_ACK, NETLINK_EXT_ACK = 270, 10, 11

RTM_NEWLINK = 16
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26

IFF_UP = 0x1
IFLA_MTU = 4
IFLA_ADDRESS = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_METRICS, RTA_TABLE = 1, 4, 5, 8, 15
RTAX_MTU = 2
RT_TABLE_MAIN = 254
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK, RT_SCOPE_NOWHERE = 0, 253, 255
RTPROT_BOOT = 3  # what ip(8) marks its routes with
RTN_UNICAST = 1
RTNH_F_ONLINK = 0x4
RTM_F_CLONED = 0x200

HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, proto, scope,
# type, flags
RTA = struct.Struct("=HH")  # rtattr: len, type
ERR = struct.Struct("=i")


class Malformed(ValueError):
    """Bytes that are not the netlink messages they claim to be."""


class _RecordType(type):
    """What typing.NamedTuple makes of `class X(Record)` and its annotated fields: a tuple whose
    fields are read-only properties, the class's values their defaults. Cheap to define (no code
    compiled, unlike collections.namedtuple) and without typing's import."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> _RecordType:
        if bases != (tuple,):  # a record, not Record itself
            fields = tuple(ns.get("__annotations__", ()))  # the names: their types stay strings
            defaults = {f: ns.pop(f) for f in fields if f in ns}
            ns.update({f: property(itemgetter(i), doc=f"field {i}") for i, f in enumerate(fields)})
            ns.update(_fields=fields, _field_defaults=defaults)
        ns["__slots__"] = ()
        return super().__new__(mcls, name, bases, ns)


class Record(tuple, metaclass=_RecordType):  # type: ignore[type-arg]
    """The base of the records of this module and _system at run time; mypy sees them as
    typing.NamedTuple's (NamedTuple is Record but under TYPE_CHECKING)."""

    _fields: tuple[str, ...] = ()
    _field_defaults: dict[str, object] = {}  # noqa: RUF012

    def __new__(cls, *args: object, **kwargs: object) -> Record:
        if kwargs or len(args) != len(cls._fields):
            args = cls._complete(args, kwargs)
        return tuple.__new__(cls, args)

    @classmethod
    def _complete(cls, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
        rest = cls._fields[len(args) :]
        if len(args) > len(cls._fields) or not set(kwargs) <= set(rest):
            raise TypeError(f"{cls.__name__}{cls._fields}: given {args} and {kwargs}")
        values = {**cls._field_defaults, **kwargs}
        if not set(rest) <= set(values):
            raise TypeError(f"{cls.__name__}{cls._fields}: given {args} and {kwargs}")
        return args + tuple(values[f] for f in rest)

    def __getnewargs__(self) -> tuple[object, ...]:  # for copy and pickle
        return tuple(self)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={v!r}" for f, v in zip(self._fields, self, strict=True))
        return f"{type(self).__name__}({fields})"

    def _asdict(self) -> dict[str, object]:
        return dict(zip(self._fields, self, strict=True))

    def _replace(self, **changes: object) -> Record:
        return type(self)(**{**self._asdict(), **changes})


if not TYPE_CHECKING:
    NamedTuple = Record


class Msg(NamedTuple):
    type: int
    flags: int
    seq: int
    payload: bytes


class Addr(NamedTuple):
    family: int
    prefixlen: int
    scope: int
    ifindex: int


class Route(NamedTuple):
    family: int
    dst_len: int
    table: int
    scope: int
    flags: int
    oif: int


class Reply(NamedTuple):
    """What the kernel said to a request: done (an ack or the end of a dump), its error (0 or
    an errno), its extended-ack text, and the dump's messages so far."""

    done: bool
    error: int
    text: str
    items: list[Msg]
    interrupted: bool


# Building ------------------------------------------------------------------------------------


def align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, data: bytes) -> bytes:
    head = RTA.pack(RTA.size + len(data), kind) + data
    return head + bytes(align(len(head)) - len(head))


def u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def message(kind: int, flags: int, seq: int, payload: bytes) -> bytes:
    return HDR.pack(HDR.size + len(payload), kind, flags, seq, 0) + payload


def link_up(index: int, mtu: int = 0) -> bytes:
    """An RTM_NEWLINK payload: the device up, with its MTU if one is given."""
    return IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP) + (
        u32(IFLA_MTU, mtu) if mtu else b""
    )


def link_address(index: int, mac: bytes) -> bytes:
    """An RTM_NEWLINK payload: the device's hardware address (a restored guest's NIC keeps the
    snapshot's until it is told its own)."""
    return IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + attr(IFLA_ADDRESS, mac)


def addr_msg(family: int, index: int, addr: bytes, prefixlen: int, flags: int = 0) -> bytes:
    """An RTM_NEWADDR payload: the address as both local and address, as ip(8) sends it."""
    head = IFADDR.pack(family, prefixlen, flags, RT_SCOPE_UNIVERSE, index)
    return head + attr(IFA_LOCAL, addr) + attr(IFA_ADDRESS, addr)


def route_msg(family: int, index: int, dst: bytes, dst_len: int, *, gateway: bytes = b"",
              scope: int = RT_SCOPE_UNIVERSE, flags: int = 0, mtu: int = 0,
              delete: bool = False) -> bytes:  # fmt: skip
    """An RTM_NEWROUTE (or, with delete, RTM_DELROUTE) payload in the main table.

    A delete leaves protocol, scope and type open (0 and RT_SCOPE_NOWHERE), so that it matches
    any route to dst on the device, as `ip route del` does.
    """
    if delete:
        head = RTMSG.pack(family, dst_len, 0, 0, RT_TABLE_MAIN, 0, RT_SCOPE_NOWHERE, 0, 0)
    else:
        head = RTMSG.pack(family, dst_len, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope, RTN_UNICAST,
                          flags)  # fmt: skip
    body = attr(RTA_DST, dst) if dst_len else b""
    body += attr(RTA_GATEWAY, gateway) if gateway else b""
    body += u32(RTA_OIF, index)
    if mtu:
        body += attr(RTA_METRICS, u32(RTAX_MTU, mtu))
    return head + body


def addr_dump(family: int) -> bytes:
    return IFADDR.pack(family, 0, 0, 0, 0)


def route_dump(family: int) -> bytes:
    return RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)


# Reading -------------------------------------------------------------------------------------


def parse(buf: bytes) -> list[Msg]:
    """The messages of one datagram."""
    out, at = [], 0
    while at + HDR.size <= len(buf):
        length, kind, flags, seq, _pid = HDR.unpack_from(buf, at)
        if length < HDR.size or at + length > len(buf):
            raise Malformed(f"a message of {length} bytes at {at} of {len(buf)}")
        out.append(Msg(kind, flags, seq, bytes(buf[at + HDR.size : at + length])))
        at += align(length)
    if at < len(buf):
        raise Malformed(f"{len(buf) - at} bytes after the last message")
    return out


def attrs(buf: bytes) -> dict[int, bytes]:
    """rtattrs by type (the last of a type wins; the nested and byte-order bits cleared)."""
    out, at = {}, 0
    while at + RTA.size <= len(buf):
        length, kind = RTA.unpack_from(buf, at)
        if length < RTA.size or at + length > len(buf):
            raise Malformed(f"an attribute of {length} bytes at {at} of {len(buf)}")
        out[kind & 0x3FFF] = bytes(buf[at + RTA.size : at + length])
        at += align(length)
    return out


def _u32_attr(found: dict[int, bytes], kind: int, default: int) -> int:
    value = found.get(kind)
    if value is None:
        return default
    if len(value) != 4:
        raise Malformed(f"attribute {kind}: {len(value)} bytes, not 4")
    return int(struct.unpack("=I", value)[0])


def read_addr(payload: bytes) -> Addr:
    if len(payload) < IFADDR.size:
        raise Malformed(f"an ifaddrmsg of {len(payload)} bytes")
    family, prefixlen, _flags, scope, index = IFADDR.unpack_from(payload)
    return Addr(family, prefixlen, scope, index)


def read_route(payload: bytes) -> Route:
    if len(payload) < RTMSG.size:
        raise Malformed(f"an rtmsg of {len(payload)} bytes")
    family, dst_len, _src, _tos, table, _proto, scope, _type, flags = RTMSG.unpack_from(payload)
    found = attrs(payload[RTMSG.size :])
    table = _u32_attr(found, RTA_TABLE, table)
    return Route(family, dst_len, table, scope, flags, _u32_attr(found, RTA_OIF, 0))


def read_error(msg: Msg) -> tuple[int, str]:
    """An NLMSG_ERROR (an ack when 0) as (errno, the kernel's extended-ack text or "")."""
    if len(msg.payload) < ERR.size + HDR.size:
        raise Malformed(f"an nlmsgerr of {len(msg.payload)} bytes")
    (error,) = ERR.unpack_from(msg.payload)
    text = ""
    if msg.flags & NLM_F_ACK_TLVS:
        at = ERR.size + HDR.size
        if not msg.flags & NLM_F_CAPPED:  # the whole request is echoed before the TLVs
            at = ERR.size + align(HDR.unpack_from(msg.payload, ERR.size)[0])
        raw = attrs(msg.payload[at:]).get(NLMSGERR_ATTR_MSG, b"")
        text = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
    return -error, text


def collect(reply: Reply, msgs: list[Msg], seq: int) -> Reply:
    """The reply to request seq, with one more datagram's messages (others' seqs skipped)."""
    items, interrupted = list(reply.items), reply.interrupted
    for msg in msgs:
        if msg.seq != seq or msg.type in (NLMSG_NOOP, NLMSG_OVERRUN):
            continue
        interrupted = interrupted or bool(msg.flags & NLM_F_DUMP_INTR)
        if msg.type == NLMSG_ERROR:
            error, text = read_error(msg)
            return Reply(True, error, text, items, interrupted)
        if msg.type == NLMSG_DONE:
            error = -ERR.unpack_from(msg.payload)[0] if len(msg.payload) >= ERR.size else 0
            return Reply(True, error, "", items, interrupted)
        items.append(msg)
    return Reply(False, 0, "", items, interrupted)


NOTHING = Reply(False, 0, "", [], False)


def describe(step: str, error: int, text: str) -> str:
    name = errno.errorcode.get(error, str(error))
    return f"netlink: {step}: {os.strerror(error)} ({name})" + (f": {text}" if text else "")


# The socket ----------------------------------------------------------------------------------


class Socket:
    """A NETLINK_ROUTE socket that asks one thing at a time and reads its answer.

    rtnetlink handles a request inside the sender's sendmsg, so the answer is queued when send
    returns: blocking reads here take microseconds (the timeout is only a bound).
    """

    def __init__(self, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                  socket.NETLINK_ROUTE)  # fmt: skip
        for option in (NETLINK_CAP_ACK, NETLINK_EXT_ACK):
            try:
                self.sock.setsockopt(SOL_NETLINK, option, 1)
            except OSError:
                pass  # an older kernel: whole echoes, no texts
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self.seq = 0
        self.buf = bytearray(1 << 16)  # more than a dump's datagram (32 KiB at most)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, kind: int, flags: int, payload: bytes) -> Reply:
        self.seq += 1
        self.sock.send(message(kind, NLM_F_REQUEST | NLM_F_ACK | flags, self.seq, payload))
        reply = NOTHING
        while not reply.done:
            n, _anc, msg_flags, _addr = self.sock.recvmsg_into([self.buf])
            if msg_flags & socket.MSG_TRUNC:
                raise Malformed("a datagram larger than the buffer")
            reply = collect(reply, parse(bytes(self.buf[:n])), self.seq)
        return reply
