"""The DNS message codec (RFC 1035, 6891, 9460): bytes in, values out, and back. No I/O.

parse_message takes any bytes and either returns a Message or raises DnsFormatError, nothing else;
names compressed anywhere it knows of are expanded, so a parsed message can be built again at any
offsets. build_message compresses owner and question names and writes rdata as parsed (names in
rdata uncompressed, which every reader takes). Record types it does not know pass as opaque rdata.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable

import attrs

Name = tuple[bytes, ...]
"""A domain name as its labels, the root left out: www.example. is (b"www", b"example")."""

A, NS, CNAME, SOA, PTR, MX, AAAA, SRV, OPT, SVCB, HTTPS, ANY = (
    1,
    2,
    5,
    6,
    12,
    15,
    28,
    33,
    41,
    64,
    65,
    255,
)
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
SVC_ECH = 5

QR, AA, TC, RD, RA = 0x8000, 0x0400, 0x0200, 0x0100, 0x0080
MAX_MESSAGE = 65535
_MAX_NAME = 255
_TYPE_NAMES = {
    A: "A",
    NS: "NS",
    CNAME: "CNAME",
    SOA: "SOA",
    PTR: "PTR",
    MX: "MX",
    AAAA: "AAAA",
    SRV: "SRV",
    OPT: "OPT",
    SVCB: "SVCB",
    HTTPS: "HTTPS",
    ANY: "ANY",
    16: "TXT",
}

# rdata layouts with names a sender may compress (RFC 3597 §4): "n" a name, a number that many
# fixed bytes.
_NAMED_RDATA: dict[int, tuple[str | int, ...]] = {
    NS: ("n",),
    3: ("n",),
    4: ("n",),
    CNAME: ("n",),
    7: ("n",),
    8: ("n",),
    9: ("n",),
    PTR: ("n",),
    39: ("n",),
    MX: (2, "n"),
    18: (2, "n"),
    21: (2, "n"),
    36: (2, "n"),
    14: ("n", "n"),
    17: ("n", "n"),
    SOA: ("n", "n", 20),
    SRV: (6, "n"),
    26: (2, "n", "n"),
}


class DnsFormatError(ValueError):
    """The bytes are not a DNS message this codec can read (or a value cannot be encoded)."""


@attrs.frozen
class Question:
    name: Name
    qtype: int
    qclass: int = CLASS_IN


@attrs.frozen
class Record:
    name: Name
    rtype: int
    rclass: int
    ttl: int
    rdata: bytes


@attrs.frozen
class Message:
    id: int
    flags: int
    questions: tuple[Question, ...] = ()
    answers: tuple[Record, ...] = ()
    authorities: tuple[Record, ...] = ()
    additionals: tuple[Record, ...] = ()

    @property
    def opcode(self) -> int:
        return (self.flags >> 11) & 0xF

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    def opt(self) -> Record | None:
        """The EDNS OPT pseudo-record, if the message has one."""
        return next((r for r in self.additionals if r.rtype == OPT), None)


@attrs.frozen
class Svcb:
    """SVCB/HTTPS rdata: priority, target and the SvcParams as (key, value) pairs in wire order."""

    priority: int
    target: Name
    params: tuple[tuple[int, bytes], ...]


def type_name(rtype: int) -> str:
    return _TYPE_NAMES.get(rtype, f"TYPE{rtype}")


def name_text(name: Name) -> str:
    """The name as text, with a trailing dot; bytes outside printable ASCII escaped as \\DDD."""

    def label(raw: bytes) -> str:
        return "".join(
            chr(b) if 0x21 <= b <= 0x7E and b not in b".\\" else f"\\{b:03d}" for b in raw
        )

    return "".join(label(part) + "." for part in name) or "."


def name_from_text(text: str) -> Name:
    """A name from dotted text (no escapes); for tests and configuration."""
    name = tuple(p.encode("ascii") for p in text.rstrip(".").split(".") if p)
    _check_name(name)
    return name


# --- parsing -----------------------------------------------------------------------------------


def parse_message(data: bytes) -> Message:
    """The message in data; DnsFormatError for anything that is not one."""
    try:
        return _parse(memoryview(data).tobytes() if not isinstance(data, bytes) else data)
    except struct.error as e:
        raise DnsFormatError(f"message cut short: {e}") from None


def parse_header_id(data: bytes) -> int | None:
    """The ID of a message at least a header long, else None (nothing can be answered)."""
    return int.from_bytes(data[:2], "big") if len(data) >= 12 else None


def _parse(data: bytes) -> Message:
    if len(data) < 12:
        raise DnsFormatError("shorter than a header")
    if len(data) > MAX_MESSAGE:
        raise DnsFormatError("longer than 65535 bytes")
    ident, flags, qd, an, ns, ar = struct.unpack_from("!6H", data, 0)
    pos = 12
    questions = []
    for _ in range(qd):
        name, pos = read_name(data, pos)
        qtype, qclass = struct.unpack_from("!HH", data, pos)
        questions.append(Question(name, qtype, qclass))
        pos += 4
    sections: list[tuple[Record, ...]] = []
    for count in (an, ns, ar):
        records = []
        for _ in range(count):
            record, pos = _read_record(data, pos)
            records.append(record)
        sections.append(tuple(records))
    return Message(ident, flags, tuple(questions), *sections)


def _read_record(data: bytes, pos: int) -> tuple[Record, int]:
    name, pos = read_name(data, pos)
    rtype, rclass, ttl, length = struct.unpack_from("!HHIH", data, pos)
    pos += 10
    end = pos + length
    if end > len(data):
        raise DnsFormatError("rdata runs past the message")
    layout = _NAMED_RDATA.get(rtype)
    rdata = data[pos:end] if layout is None else _expand_rdata(data, pos, end, layout)
    return Record(name, rtype, rclass, ttl, rdata), end


def _expand_rdata(data: bytes, pos: int, end: int, layout: tuple[str | int, ...]) -> bytes:
    out = bytearray()
    for part in layout:
        if part == "n":
            name, pos = read_name(data, pos, limit=end)
            out += encode_name(name)
        else:
            assert isinstance(part, int)
            if pos + part > end:
                raise DnsFormatError("rdata too short")
            out += data[pos : pos + part]
            pos += part
    if pos != end:
        raise DnsFormatError("rdata longer than its fields")
    return bytes(out)


def read_name(
    data: bytes, pos: int, limit: int | None = None, compressed: bool = True
) -> tuple[Name, int]:
    """The name at pos and the offset after it, following compression pointers backwards only.

    `limit` bounds where the name itself may run (its rdata's end); pointers may reach anywhere
    before them. A pointer must point before itself, so no chain can loop.
    """
    end = len(data) if limit is None else limit
    labels: list[bytes] = []
    total = 1
    after: int | None = None
    while True:
        if pos >= end:
            raise DnsFormatError("name runs past its end")
        length = data[pos]
        if length & 0xC0 == 0xC0:
            if not compressed:
                raise DnsFormatError("compression where none is allowed")
            if pos + 1 >= end:
                raise DnsFormatError("pointer cut short")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= pos:
                raise DnsFormatError("compression pointer does not point backwards")
            if after is None:
                after = pos + 2
            pos, end = target, len(data)
            continue
        if length & 0xC0:
            raise DnsFormatError("reserved label type")
        if length == 0:
            return tuple(labels), (pos + 1 if after is None else after)
        total += length + 1
        if total > _MAX_NAME or pos + 1 + length > end:
            raise DnsFormatError("name too long or cut short")
        labels.append(data[pos + 1 : pos + 1 + length])
        pos += 1 + length


# --- building ----------------------------------------------------------------------------------


def _check_name(name: Name) -> None:
    if sum(len(label) + 1 for label in name) + 1 > _MAX_NAME:
        raise DnsFormatError("name longer than 255 bytes")
    if any(not 1 <= len(label) <= 63 for label in name):
        raise DnsFormatError("label not of 1 to 63 bytes")


def encode_name(name: Name) -> bytes:
    """The name uncompressed, as rdata carries it."""
    _check_name(name)
    return b"".join(bytes((len(label),)) + label for label in name) + b"\0"


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()
        self.offsets: dict[tuple[bytes, ...], int] = {}

    def name(self, name: Name) -> None:
        _check_name(name)
        for i in range(len(name)):
            suffix = name[i:]  # exact bytes: a pointer must give back the case written
            known = self.offsets.get(suffix)
            if known is not None:
                self.out += struct.pack("!H", 0xC000 | known)
                return
            if len(self.out) < 0x4000:
                self.offsets[suffix] = len(self.out)
            self.out += bytes((len(name[i]),)) + name[i]
        self.out.append(0)

    def record(self, record: Record) -> None:
        self.name(record.name)
        if len(record.rdata) > 0xFFFF:
            raise DnsFormatError("rdata longer than 65535 bytes")
        self.out += struct.pack("!HHIH", record.rtype, record.rclass, record.ttl, len(record.rdata))
        self.out += record.rdata


def build_message(message: Message) -> bytes:
    """The message's wire form; DnsFormatError if it cannot be encoded (as beyond 65535 bytes)."""
    w = _Writer()
    counts = (
        len(message.questions),
        len(message.answers),
        len(message.authorities),
        len(message.additionals),
    )
    try:
        w.out += struct.pack("!6H", message.id, message.flags, *counts)
        for q in message.questions:
            w.name(q.name)
            w.out += struct.pack("!HH", q.qtype, q.qclass)
        for section in (message.answers, message.authorities, message.additionals):
            for record in section:
                w.record(record)
    except struct.error as e:
        raise DnsFormatError(f"value out of range: {e}") from None
    if len(w.out) > MAX_MESSAGE:
        raise DnsFormatError("message longer than 65535 bytes")
    return bytes(w.out)


# --- rdata -------------------------------------------------------------------------------------


def address_rdata(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return address.packed


def rdata_text(rtype: int, rdata: bytes) -> str:
    """A short text of a record's data for the traffic records."""
    try:
        if rtype == A and len(rdata) == 4:
            return str(ipaddress.IPv4Address(rdata))
        if rtype == AAAA and len(rdata) == 16:
            return str(ipaddress.IPv6Address(rdata))
        if rtype in (CNAME, NS, PTR, 39):
            return name_text(read_name(rdata, 0, compressed=False)[0])
        if rtype in (SVCB, HTTPS):
            svcb = parse_svcb(rdata)
            keys = ",".join(str(k) for k, _ in svcb.params)
            return f"{svcb.priority} {name_text(svcb.target)} keys={keys}"
    except DnsFormatError:
        pass
    return f"{len(rdata)} bytes"


def parse_svcb(rdata: bytes) -> Svcb:
    """SVCB/HTTPS rdata (RFC 9460); DnsFormatError if malformed."""
    if len(rdata) < 3:
        raise DnsFormatError("SVCB rdata too short")
    priority = int.from_bytes(rdata[:2], "big")
    target, pos = read_name(rdata, 2, compressed=False)
    params = []
    while pos < len(rdata):
        if pos + 4 > len(rdata):
            raise DnsFormatError("SvcParam cut short")
        key, length = struct.unpack_from("!HH", rdata, pos)
        if pos + 4 + length > len(rdata):
            raise DnsFormatError("SvcParam value runs past the rdata")
        params.append((key, rdata[pos + 4 : pos + 4 + length]))
        pos += 4 + length
    return Svcb(priority, target, tuple(params))


def build_svcb(svcb: Svcb) -> bytes:
    out = bytearray(struct.pack("!H", svcb.priority)) + encode_name(svcb.target)
    for key, value in svcb.params:
        out += struct.pack("!HH", key, len(value)) + value
    return bytes(out)


def without_ech(records: Iterable[Record]) -> tuple[tuple[Record, ...], int]:
    """The records with ech taken out of every SVCB/HTTPS one, malformed ones dropped, and how
    many records changed (0: the caller may keep the bytes it has)."""
    out: list[Record] = []
    changed = 0
    for record in records:
        if record.rtype not in (SVCB, HTTPS):
            out.append(record)
            continue
        try:
            svcb = parse_svcb(record.rdata)
        except DnsFormatError:
            changed += 1  # one a client might read ech from anyway: not passed on
            continue
        if any(key == SVC_ECH for key, _ in svcb.params):
            kept = tuple(p for p in svcb.params if p[0] != SVC_ECH)
            record = attrs.evolve(record, rdata=build_svcb(attrs.evolve(svcb, params=kept)))
            changed += 1
        out.append(record)
    return tuple(out), changed


def _skip_name(data: bytes, pos: int) -> int:
    while True:
        if pos >= len(data):
            raise DnsFormatError("name runs past the message")
        length = data[pos]
        if length & 0xC0 == 0xC0:
            return pos + 2
        if length & 0xC0:
            raise DnsFormatError("reserved label type")
        pos += 1 + length
        if length == 0:
            return pos


def ttl_offsets(wire: bytes) -> list[tuple[int, int]]:
    """(offset, TTL) of every record's TTL field but OPT's (whose TTL field holds flags)."""
    try:
        qd, an, ns, ar = struct.unpack_from("!4H", wire, 4)
        pos = 12
        for _ in range(qd):
            pos = _skip_name(wire, pos) + 4
        out = []
        for _ in range(an + ns + ar):
            pos = _skip_name(wire, pos)
            rtype, _cls, ttl, length = struct.unpack_from("!HHIH", wire, pos)
            if rtype != OPT:
                out.append((pos + 4, ttl))
            pos += 10 + length
        if pos > len(wire):
            raise DnsFormatError("rdata runs past the message")
        return out
    except struct.error as e:
        raise DnsFormatError(f"message cut short: {e}") from None
