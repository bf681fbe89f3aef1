"""A cache of upstream answers, keyed by question and upstreams, whose TTLs keep going down.

Answers pass as the upstream gave them, but for their TTLs: a cached answer is sent with every TTL
less the whole seconds it has been kept, and it leaves the cache once its shortest TTL has run
out, so a client never holds a record longer than the upstream allowed. Only complete NOERROR and
NXDOMAIN answers with at least one record are kept (a negative answer lives as long as its SOA);
nothing truncated, failed or without a TTL. Pure: the caller gives the time.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import attrs

from . import _dnsmsg as m
from ._dnsresolver import Forward, restore_client

Key = tuple[object, ...]


@attrs.frozen
class _Entry:
    wire: bytes
    stored: float
    ttls: tuple[tuple[int, int], ...]  # (offset of a TTL field, its TTL) of every record but OPT
    lifetime: int
    upstream: str | None
    rcode: int
    answers: tuple[str, ...]


@attrs.frozen
class Hit:
    wire: bytes
    upstream: str | None
    rcode: int
    answers: tuple[str, ...]


def cache_key(fwd: Forward) -> Key:
    q = fwd.query.questions[0]
    opt = fwd.query.opt()
    dnssec_ok = bool(opt is not None and opt.ttl & 0x8000)
    flags = fwd.query.flags & (m.RD | 0x0010)  # RD and CD change what an upstream answers
    return (fwd.upstreams, tuple(x.lower() for x in q.name), q.qtype, q.qclass, flags, dnssec_ok)


class AnswerCache:
    def __init__(self, max_entries: int = 10_000, max_ttl: int = 86_400) -> None:
        self.max_entries = max_entries
        self.max_ttl = max_ttl
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()

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
        self._entries[key] = _Entry(
            wire, now, tuple(ttls), lifetime, upstream, flags & 0xF, answers
        )
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: Key, fwd: Forward, now: float) -> Hit | None:
        """The reply for this client, TTLs lowered, or None (never kept, expired, or too large for
        the client over UDP, which then asks upstream as it would without a cache)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        age = int(now - entry.stored)
        if age >= entry.lifetime or now < entry.stored:
            del self._entries[key]
            return None
        if len(entry.wire) > fwd.limit:
            return None
        buf = bytearray(restore_client(entry.wire, fwd.query.id, fwd.wire))
        for offset, ttl in entry.ttls:
            struct.pack_into("!I", buf, offset, max(0, ttl - age))
        self._entries.move_to_end(key)
        return Hit(bytes(buf), entry.upstream, entry.rcode, entry.answers)
