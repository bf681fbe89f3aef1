"""DHCPv6 messages (RFC 8415), the few a client needs, encoded and decoded without I/O.

Written here rather than taken from a library: PyPI's DHCPv6 code is scapy's, whose import costs
seconds under TCG on the node's one boot path, and the client needs eleven options. The decoder
takes what the client asked for and ignores the rest (tests/unit/test_hostinit_dhcp6wire.py).
"""

from __future__ import annotations

import ipaddress
import struct

import attrs

from feos.errors import Code, FeosError

SOLICIT, ADVERTISE, REQUEST, RENEW, REBIND, REPLY = 1, 2, 3, 5, 6, 7
O_CLIENTID, O_SERVERID, O_IA_NA, O_IAADDR, O_ORO, O_ELAPSED = 1, 2, 3, 5, 6, 8
O_STATUS, O_DNS, O_SNTP, O_IA_PD, O_IAPREFIX, O_NTP = 13, 23, 31, 25, 26, 56
NTP_SUB_ADDR, NTP_SUB_MC, NTP_SUB_FQDN = 1, 2, 3
NO_ADDRS_AVAIL, NO_PREFIX_AVAIL = 2, 6
IAID = 1


@attrs.frozen
class Address:
    address: ipaddress.IPv6Address
    preferred: int
    valid: int


@attrs.frozen
class Prefix:
    prefix: ipaddress.IPv6Network
    preferred: int
    valid: int


@attrs.frozen
class IA:
    """An IA_NA (addresses) or IA_PD (prefixes) as the server sent it."""

    t1: int
    t2: int
    addresses: tuple[Address, ...] = ()
    prefixes: tuple[Prefix, ...] = ()
    status: int = 0
    message: str = ""


@attrs.frozen
class Message:
    kind: int
    xid: int
    client_id: bytes = b""
    server_id: bytes = b""
    ia_na: IA | None = None
    ia_pd: IA | None = None
    dns: tuple[ipaddress.IPv6Address, ...] = ()
    ntp: tuple[ipaddress.IPv6Address | str, ...] = ()
    status: int = 0
    message: str = ""


def duid_ll(mac: bytes) -> bytes:
    """DUID-LL (type 3) of an Ethernet address: stable across boots, no clock needed."""
    return struct.pack("!HH", 3, 1) + mac


def _opt(code: int, data: bytes) -> bytes:
    return struct.pack("!HH", code, len(data)) + data


def encode(
    kind: int,
    xid: int,
    client_id: bytes,
    *,
    server_id: bytes = b"",
    ia_na: IA | None = None,
    ia_pd: IA | None = None,
    elapsed_cs: int = 0,
) -> bytes:
    """A client's message: its IAs with the addresses and prefixes it holds (for a Request,
    Renew or Rebind), asking for resolvers and NTP servers."""
    out = struct.pack("!I", (kind << 24) | (xid & 0xFFFFFF))
    out += _opt(O_CLIENTID, client_id)
    if server_id:
        out += _opt(O_SERVERID, server_id)
    out += _opt(O_ORO, struct.pack("!HHH", O_DNS, O_NTP, O_SNTP))
    out += _opt(O_ELAPSED, struct.pack("!H", min(elapsed_cs, 0xFFFF)))
    if ia_na is not None:
        inner = b"".join(
            _opt(O_IAADDR, a.address.packed + struct.pack("!II", 0, 0)) for a in ia_na.addresses
        )
        out += _opt(O_IA_NA, struct.pack("!III", IAID, 0, 0) + inner)
    if ia_pd is not None:
        inner = b"".join(
            _opt(
                O_IAPREFIX,
                struct.pack("!IIB", 0, 0, p.prefix.prefixlen) + p.prefix.network_address.packed,
            )
            for p in ia_pd.prefixes
        )
        out += _opt(O_IA_PD, struct.pack("!III", IAID, 0, 0) + inner)
    return out


def _options(data: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i < len(data):
        if i + 4 > len(data):
            raise FeosError(Code.INVALID_ARGUMENT, "DHCPv6: an option's header is cut short")
        code, length = struct.unpack_from("!HH", data, i)
        body = data[i + 4 : i + 4 + length]
        if len(body) != length:
            raise FeosError(Code.INVALID_ARGUMENT, f"DHCPv6: option {code} is cut short")
        out.append((code, body))
        i += 4 + length
    return out


def _status(body: bytes) -> tuple[int, str]:
    if len(body) < 2:
        raise FeosError(Code.INVALID_ARGUMENT, "DHCPv6: a status code without its code")
    return struct.unpack_from("!H", body)[0], body[2:].decode("utf-8", "replace")


def _addresses(body: bytes) -> tuple[ipaddress.IPv6Address, ...]:
    if len(body) % 16:
        raise FeosError(Code.INVALID_ARGUMENT, "DHCPv6: an address list not of 16-byte items")
    return tuple(ipaddress.IPv6Address(body[i : i + 16]) for i in range(0, len(body), 16))


def _ia(body: bytes, pd: bool) -> IA:
    if len(body) < 12:
        raise FeosError(Code.INVALID_ARGUMENT, "DHCPv6: an IA shorter than its header")
    _, t1, t2 = struct.unpack_from("!III", body)
    addresses: list[Address] = []
    prefixes: list[Prefix] = []
    status, message = 0, ""
    for code, sub in _options(body[12:]):
        if code == O_STATUS:
            status, message = _status(sub)
        elif code == O_IAADDR and not pd and len(sub) >= 24:
            pref, valid = struct.unpack_from("!II", sub, 16)
            addresses.append(Address(ipaddress.IPv6Address(sub[:16]), pref, valid))
        elif code == O_IAPREFIX and pd and len(sub) >= 25:
            pref, valid, plen = struct.unpack_from("!IIB", sub)
            if plen > 128:
                raise FeosError(Code.INVALID_ARGUMENT, f"DHCPv6: a prefix of length {plen}")
            net = ipaddress.IPv6Network((ipaddress.IPv6Address(sub[9:25]), plen), strict=False)
            prefixes.append(Prefix(net, pref, valid))
    return IA(t1, t2, tuple(addresses), tuple(prefixes), status, message)


def _ntp(body: bytes) -> list[ipaddress.IPv6Address | str]:
    out: list[ipaddress.IPv6Address | str] = []
    for code, sub in _options(body):
        if code in (NTP_SUB_ADDR, NTP_SUB_MC) and len(sub) == 16:
            out.append(ipaddress.IPv6Address(sub))
        elif code == NTP_SUB_FQDN:
            labels, i = [], 0
            while i < len(sub) and sub[i]:
                labels.append(sub[i + 1 : i + 1 + sub[i]].decode("ascii", "replace"))
                i += 1 + sub[i]
            if labels:
                out.append(".".join(labels))
    return out


def decode(data: bytes) -> Message:
    """A server's message; INVALID_ARGUMENT for one that is malformed where the client reads."""
    if len(data) < 4:
        raise FeosError(Code.INVALID_ARGUMENT, "DHCPv6: a message shorter than its header")
    head = struct.unpack_from("!I", data)[0]
    fields: dict[str, object] = {}
    ntp: list[ipaddress.IPv6Address | str] = []
    for code, body in _options(data[4:]):
        if code == O_CLIENTID:
            fields["client_id"] = body
        elif code == O_SERVERID:
            fields["server_id"] = body
        elif code == O_IA_NA and "ia_na" not in fields:
            fields["ia_na"] = _ia(body, pd=False)
        elif code == O_IA_PD and "ia_pd" not in fields:
            fields["ia_pd"] = _ia(body, pd=True)
        elif code == O_DNS:
            fields["dns"] = _addresses(body)
        elif code == O_NTP:
            ntp += _ntp(body)
        elif code == O_SNTP:
            ntp += list(_addresses(body))
        elif code == O_STATUS:
            fields["status"], fields["message"] = _status(body)
    return Message(kind=head >> 24, xid=head & 0xFFFFFF, ntp=tuple(ntp), **fields)  # type: ignore[arg-type]
