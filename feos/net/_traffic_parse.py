"""Pure parsers of what the pods send: IP packets as nflog copies them, a TLS ClientHello's
server name, an HTTP request's Host, and the prefix of a logged drop.

All take bytes a pod chose and must not crash on any of them: what does not parse is None.
"""

from __future__ import annotations

import ipaddress
import re
import struct

import attrs

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# The table's reasons (feos.net._nft.REASONS) and a few spellings of them others may log.
DROP_REASONS = ("spoofed", "router", "input", "invalid", "deny", "no-rule",
                "router-advertisement", "redirect")
_TAP = re.compile(r"^pod-[0-9a-z]{8,11}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.-]{1,253}$")
_IPV6_EXT = {0, 43, 44, 51, 60}


@attrs.frozen
class Packet:
    family: int  # 4 or 6
    src: Address
    dst: Address
    protocol: int
    sport: int
    dport: int
    seq: int  # TCP's sequence number, 0 for others
    payload: bytes  # the transport's payload


def parse_packet(data: bytes) -> Packet | None:
    """An IPv4 or IPv6 packet with its TCP or UDP ports and payload (ports 0 for others)."""
    if not data:
        return None
    version = data[0] >> 4
    if version == 4 and len(data) >= 20:
        ihl = (data[0] & 0x0F) * 4
        if ihl < 20 or len(data) < ihl:
            return None
        total = struct.unpack_from("!H", data, 2)[0]
        frag = struct.unpack_from("!H", data, 6)[0] & 0x1FFF
        body = data[ihl : max(ihl, min(total, len(data)))]
        src, dst = ipaddress.IPv4Address(data[12:16]), ipaddress.IPv4Address(data[16:20])
        return _transport(4, src, dst, data[9], b"" if frag else body, fragment=bool(frag))
    if version == 6 and len(data) >= 40:
        proto, off = data[6], 40
        while proto in _IPV6_EXT and off + 8 <= len(data):
            if proto == 44:  # fragment header: the ports are in the first fragment only
                return _transport(6, *_v6(data), proto, b"", fragment=True)
            proto, off = data[off], off + (8 if proto == 44 else (data[off + 1] + 1) * 8)
        return _transport(6, *_v6(data), proto, data[off:])
    return None


def _v6(data: bytes) -> tuple[Address, Address]:
    return ipaddress.IPv6Address(data[8:24]), ipaddress.IPv6Address(data[24:40])


def _transport(family: int, src: Address, dst: Address, proto: int, body: bytes, *,
               fragment: bool = False) -> Packet:
    if proto == 6 and len(body) >= 20 and not fragment:
        sport, dport, seq = struct.unpack_from("!HHI", body)
        off = (body[12] >> 4) * 4
        return Packet(family, src, dst, proto, sport, dport, seq, body[off:] if off >= 20 else b"")
    if proto == 17 and len(body) >= 8 and not fragment:
        sport, dport = struct.unpack_from("!HH", body)
        return Packet(family, src, dst, proto, sport, dport, 0, body[8:])
    return Packet(family, src, dst, proto, 0, 0, 0, b"")


# --- TLS ------------------------------------------------------------------------------------

NEED_MORE = "need-more"  # the ClientHello goes on past the bytes given


def tls_server_name(data: bytes) -> str | None:
    """The server_name of a TLS ClientHello at the start of a TCP stream, NEED_MORE while the
    record is cut short, or None: not TLS, no SNI, or a name that is not a host name."""
    if len(data) < 5:
        return NEED_MORE if data and data[0] == 0x16 else None
    if data[0] != 0x16 or data[1] != 0x03:
        return None
    length = struct.unpack_from("!H", data, 3)[0]
    hello = data[5 : 5 + length]
    if len(hello) < 4:
        return NEED_MORE if len(data) < 5 + length else None
    if hello[0] != 0x01:
        return None
    hello_len = int.from_bytes(hello[1:4], "big")
    body = hello[4 : 4 + hello_len]
    name = _sni_in_hello(body)
    if name is None and len(body) < hello_len:
        return NEED_MORE  # the hello spans records or packets we have not seen yet
    return name


def _sni_in_hello(b: bytes) -> str | None:
    off = 2 + 32  # version, random
    for width in (1, 2, 1):  # session id, cipher suites, compression methods
        if off + width > len(b):
            return None
        off += width + int.from_bytes(b[off : off + width], "big")
    if off + 2 > len(b):
        return None
    end = min(len(b), off + 2 + struct.unpack_from("!H", b, off)[0])
    off += 2
    while off + 4 <= end:
        etype, elen = struct.unpack_from("!HH", b, off)
        ext = b[off + 4 : off + 4 + elen]
        if etype == 0:
            return _sni_extension(ext)
        off += 4 + elen
    return None


def _sni_extension(ext: bytes) -> str | None:
    if len(ext) < 2:
        return None
    off, end = 2, min(len(ext), 2 + struct.unpack_from("!H", ext)[0])
    while off + 3 <= end:
        kind, nlen = ext[off], struct.unpack_from("!H", ext, off + 1)[0]
        name = ext[off + 3 : off + 3 + nlen]
        if kind == 0 and len(name) == nlen:
            return _hostname(name)
        off += 3 + nlen
    return None


def _hostname(raw: bytes) -> str | None:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text.lower().rstrip(".") if _HOSTNAME.match(text) else None


# --- HTTP -----------------------------------------------------------------------------------

_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ",
            b"CONNECT ", b"TRACE ")


def http_host(data: bytes) -> str | None:
    """The Host of an HTTP/1 request at the start of a TCP stream (without its port), NEED_MORE
    while its head is cut short, or None."""
    if not any(data.startswith(m) or m.startswith(data) for m in _METHODS):
        return None
    head_end = data.find(b"\r\n\r\n")
    head = data if head_end < 0 else data[:head_end]
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"host":
            return _host_only(value.strip())
    return NEED_MORE if head_end < 0 and len(data) < 8192 else None


def _host_only(value: bytes) -> str | None:
    if value.startswith(b"["):  # [v6]:port
        inner = value[1:].split(b"]", 1)[0]
        try:
            return str(ipaddress.IPv6Address(inner.decode("ascii")))
        except (ValueError, UnicodeDecodeError):
            return None
    return _hostname(value.rsplit(b":", 1)[0] if value.count(b":") == 1 else value)


# --- drops ----------------------------------------------------------------------------------


@attrs.frozen
class DropPrefix:
    reason: str
    tap: str | None


def parse_drop_prefix(prefix: str) -> DropPrefix:
    """The reason and the pod's TAP of a logged drop: words split by spaces or colons, one a
    known reason, one a TAP name (the table logs "feos:<reason>:<TAP>" or "feos:<reason>")."""
    words = [w for w in re.split(r"[\s:]+", prefix) if w and w != "feos"]
    reason = next((w for w in words if w in DROP_REASONS), words[0] if words else "unknown")
    tap = next((w for w in words if _TAP.match(w)), None)
    return DropPrefix(reason, tap)
