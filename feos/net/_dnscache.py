"""A cache of upstream answers, keyed by question and upstreams, whose TTLs keep going down.

Answers pass as the upstream gave them, but for their TTLs: a cached answer is sent with every TTL
less the whole seconds it has been kept, and it leaves the cache once its shortest TTL has run
out, so a client never holds a record longer than the upstream allowed. Only complete NOERROR and
NXDOMAIN answers with at least one record are kept (a negative answer lives as long as its SOA);
nothing truncated, failed or without a TTL. Pure: the caller gives the time.

The key is made from wire bytes (`make_key`), so that the fast path (_dnsfast), which never parses
a query into a Message, and the slow path (`cache_key` of a Forward) find the same entries.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import attrs

from . import _dnsmsg as m
from ._dnsresolver import Forward
from ._nametable import Address

Key = bytes  # a bytes object keeps its hash: a lookup of a key made once costs no hashing

# Bits of a key beside RD (0x0100) and CD (0x0010), the header flags that change an answer.
KEY_DO = 0x0001  # the query's OPT asks for DNSSEC records
KEY_EDNS = 0x0002  # the query has an OPT: an answer with an OPT goes to no client without one
KEY_FLAGS = m.RD | 0x0010


@attrs.define(slots=True)
class _Entry:
    wire: bytes
    stored: float
    ttls: tuple[tuple[int, int], ...]  # (offset of a TTL field, its TTL) of every record but OPT
    lifetime: int
    upstream: str | None
    rcode: int
    answers: tuple[str, ...]
    aged: bytes  # wire with every TTL lowered by aged_for seconds: made once per second of age
    aged_for: int = 0


@attrs.frozen
class Hit:
    wire: bytes
    upstream: str | None
    rcode: int
    answers: tuple[str, ...]


_UPSTREAM_TEXTS_KEPT = 1024
upstream_texts: dict[int, tuple[tuple[Address, ...], bytes]] = {}  # by id, the tuple held


def upstreams_text(upstreams: tuple[Address, ...]) -> bytes:
    """The upstreams as the start of a key: an address's hash is Python code, run on every
    lookup, a string's is computed once. Kept per tuple, which the pods' records share."""
    known = upstream_texts.get(id(upstreams))
    if known is not None and known[0] is upstreams:
        return known[1]
    text = " ".join(map(str, upstreams)).encode() + b"|"
    if len(upstream_texts) >= _UPSTREAM_TEXTS_KEPT:
        upstream_texts.clear()
    upstream_texts[id(upstreams)] = (upstreams, text)
    return text


def make_key(upstreams: tuple[Address, ...], name: bytes, qtype_class: int, bits: int) -> Key:
    """`name`: the question's name in wire form (uncompressed, root included) in lower case;
    `qtype_class`: qtype << 16 | qclass; `bits`: the query's RD and CD, KEY_DO, KEY_EDNS. One
    bytes object: the upstreams' text ends at its "|", which no address holds, and the name at
    its root label, the fixed 6 bytes after it."""
    return upstreams_text(upstreams) + name + (qtype_class << 16 | bits).to_bytes(6, "big")


def cache_key(fwd: Forward) -> Key:
    q = fwd.query.questions[0]
    opt = fwd.query.opt()
    bits = fwd.query.flags & KEY_FLAGS
    if opt is not None:
        bits |= KEY_EDNS | (KEY_DO if opt.ttl & 0x8000 else 0)
    name = m.encode_name(tuple(x.lower() for x in q.name))
    return make_key(fwd.upstreams, name, q.qtype << 16 | q.qclass, bits)


class AnswerCache:
    def __init__(self, max_entries: int = 10_000, max_ttl: int = 86_400) -> None:
        self.max_entries = max_entries
        self.max_ttl = max_ttl
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        # For the hot path (_dnsfast.answer_batch), which checks an entry's age itself: the entry
        # kept for a key, unchecked, and making a kept one the most recently used, as `fresh` does.
        self.peek = self._entries.get
        self.touch = self._entries.move_to_end

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, key: Key, wire: bytes, now: float, upstream: str | None, answers: tuple[str, ...]
    ) -> None:
        """Keep a reply as it went to a client, if it may be kept."""
        flags = int.from_bytes(wire[2:4], "big")
        if flags & m.TC or flags & 0xF not in (m.NOERROR, m.NXDOMAIN):
            return
        try:
            ttls = m.ttl_offsets(wire)
        except m.DnsFormatError:
            return
        if not ttls:
            return
        lifetime = min(self.max_ttl, *(ttl for _, ttl in ttls))
        if lifetime <= 0:
            return
        entry = _Entry(wire, now, tuple(ttls), lifetime, upstream, flags & 0xF, answers, wire)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: Key, fwd: Forward, now: float) -> Hit | None:
        """The reply for this client, TTLs lowered, or None (never kept, expired, or too large for
        the client over UDP, which then asks upstream as it would without a cache)."""
        name_end = 12 + len(m.encode_name(fwd.query.questions[0].name))
        found = self.answer(key, now, fwd.limit, fwd.wire[:2], fwd.wire[12:name_end])
        if found is None:
            return None
        wire, entry = found
        return Hit(wire, entry.upstream, entry.rcode, entry.answers)

    def answer(
        self, key: Key, now: float, limit: int, ident: bytes, name: bytes
    ) -> tuple[bytes, _Entry] | None:
        """The kept reply with the client's ID (2 bytes) and its spelling of the question's name
        (wire form, as long as the kept one: the key holds it in lower case), or None."""
        entry = self.fresh(key, now, limit)
        if entry is None:
            return None
        aged = entry.aged
        return ident + aged[2:12] + name + aged[12 + len(name) :], entry

    def fresh(self, key: Key, now: float, limit: int) -> _Entry | None:
        """The entry whose `aged` bytes are the reply now (TTLs lowered, the kept ID and name),
        made the most recently used; None if never kept, expired (then forgotten) or longer than
        `limit`. An entry stays the same object while it is kept: a caller may hold on to it and
        to what it made of it while `aged_for` stays int(now - stored) (see _dnsfast)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        age = int(now - entry.stored)
        if age >= entry.lifetime or now < entry.stored:
            del self._entries[key]
            return None
        if len(entry.wire) > limit:
            return None
        if age != entry.aged_for:
            entry.aged, entry.aged_for = _aged(entry, age), age
        self._entries.move_to_end(key)
        return entry

def _aged(entry: _Entry, age: int) -> bytes:
    buf = bytearray(entry.wire)
    for offset, ttl in entry.ttls:
        struct.pack_into("!I", buf, offset, max(0, ttl - age))
    return bytes(buf)
