"""The hot case on raw bytes: a plain query from a pod whose answer the cache holds.

Theory of operation. Most queries a pod sends are the same few names again: a header, one
uncompressed question, perhaps an OPT, and an answer in the cache. `cached_reply` reads just that
from the bytes (where the question ends, its type and class, the OPT's payload, version and DO),
makes the cache key from the question's bytes in lower case, and sends the kept bytes with the
client's ID and spelling patched in: no Message, no Record, no parse of the answer. Anything else
(another opcode, more sections, a compressed or one-label name that a name table may hold, EDNS
other than version 0, a stranger, a miss) returns None, and the caller takes the slow path
(_dnsresolver.decide, then `slow_cached_reply`), which gives the same answer wherever the fast
path gives one: tests/unit/test_dns_fast.py holds both to that for any bytes.
"""

from __future__ import annotations

from ._dnscache import (
    KEY_DO,
    KEY_EDNS,
    KEY_FLAGS,
    AnswerCache,
    cache_key,
    upstream_texts,
    upstreams_text,
)
from ._dnsmsg import MAX_MESSAGE, name_text
from ._dnsresolver import Forward, PodDns, QueryRecord, Reply, Transport
from ._nametable import Address

_ONE_QUESTION = b"\x00\x01\x00\x00\x00\x00\x00\x00"  # qd an ns ar: 1 0 0 0
_ONE_QUESTION_OPT = b"\x00\x01\x00\x00\x00\x00\x00\x01"  # and one additional: the OPT
_OPT_HEAD = b"\x00\x00\x29"  # the root name, type 41
_SCANS_KEPT = 4096
_SCANNED_AT_MOST = 512  # bytes of a query whose scan is kept: at most 2 MB kept in all

# What a scan finds: the offset after the question's name, qtype << 16 | qclass, the most the
# client takes over UDP, the key's bits, the name in lower case, the name as records spell it.
Scan = tuple[int, int, int, int, bytes, str]
_scans: dict[bytes, Scan | None] = {}  # by the query's bytes after its ID: pods repeat queries
_UNSEEN: Scan = (0, 0, 0, 0, b"", "")


def cached_reply(
    data: bytes,
    source: str,
    pod: PodDns | None,
    default_upstreams: tuple[Address, ...],
    cache: AnswerCache,
    now: float,
    transport: Transport = "udp",
) -> tuple[bytes, QueryRecord] | None:
    """The answer from the cache and its record, or None: the slow path decides."""
    if pod is None:
        return None
    after_id = data[2:]
    scan = _scans.get(after_id, _UNSEEN)
    if scan is _UNSEEN:
        scan = _scan(data)
        if len(data) <= _SCANNED_AT_MOST:
            if len(_scans) >= _SCANS_KEPT:
                _scans.clear()
            _scans[after_id] = scan
    if scan is None:
        return None
    end, qtype_class, udp_limit, bits, lower, text = scan
    upstreams = pod.upstreams or default_upstreams
    known = upstream_texts.get(id(upstreams))  # upstreams_text and make_key inline: hot path
    text_ups = (
        known[1] if known is not None and known[0] is upstreams else upstreams_text(upstreams)
    )
    key = (text_ups, lower, qtype_class, bits)
    limit = udp_limit if transport == "udp" else MAX_MESSAGE
    found = cache.answer(key, now, limit, data[:2], data[12:end])
    if found is None:
        return None
    wire, entry = found
    record = QueryRecord(
        now,
        source,
        pod.pod_id,
        text,
        qtype_class >> 16,
        entry.rcode,
        entry.answers,
        entry.upstream,
        transport,
        cached=True,
    )
    return wire, record


def _scan(data: bytes) -> Scan | None:
    """What the fast path needs of a query, or None if the query is not one it answers."""
    if not 17 <= len(data) <= MAX_MESSAGE or data[2] & 0xF8:  # QR, opcode
        return None
    end = _name_end(data)
    if not end or end + 4 > len(data):
        return None
    qtype_class = int.from_bytes(data[end : end + 4], "big")
    if qtype_class & 0xFFFF == 1 and end == 14 + data[12]:
        return None  # one label of class IN: the pod's name tables may hold it
    bits, limit, counts = ((data[2] << 8) | data[3]) & KEY_FLAGS, 512, data[4:12]
    if counts == _ONE_QUESTION_OPT:
        opt = _opt(data, end + 4)
        if opt < 0:
            return None
        bits |= KEY_EDNS | (opt & KEY_DO)
        limit = max(512, opt >> 8)
    elif counts != _ONE_QUESTION:
        return None
    name = data[12:end]
    return end, qtype_class, limit, bits, name.lower(), _name_text(name)


def _name_end(data: bytes) -> int:
    """The offset after the question's name if it is uncompressed and at most 255 bytes, else 0."""
    pos, size = 12, len(data)
    while pos < size:
        length = data[pos]
        if not length:
            return pos + 1 if pos <= 12 + 254 else 0
        if length > 63:
            return 0  # a pointer or a reserved label type: the slow path's to judge
        pos += 1 + length
    return 0


def _opt(data: bytes, pos: int) -> int:
    """payload << 8 | KEY_DO of the OPT at pos if it is one of version 0 that fits, else -1."""
    if data[pos : pos + 3] != _OPT_HEAD or pos + 11 > len(data):
        return -1
    if data[pos + 6]:
        return -1  # another EDNS version: BADVERS
    rdata_end = pos + 11 + ((data[pos + 9] << 8) | data[pos + 10])
    if rdata_end > len(data):
        return -1
    payload = (data[pos + 3] << 8) | data[pos + 4]
    return payload << 8 | (KEY_DO if data[pos + 7] & 0x80 else 0)


def _name_text(wire: bytes) -> str:
    labels, pos = [], 0
    while wire[pos]:
        labels.append(wire[pos + 1 : pos + 1 + wire[pos]])
        pos += 1 + wire[pos]
    return name_text(tuple(labels))


def slow_cached_reply(fwd: Forward, cache: AnswerCache, now: float) -> Reply | None:
    """The slow path's answer from the cache to a query `decide` would forward, or None."""
    hit = cache.get(cache_key(fwd), fwd, now)
    if hit is None:
        return None
    q = fwd.query.questions[0]
    record = QueryRecord(
        now,
        fwd.source,
        fwd.pod,
        name_text(q.name),
        q.qtype,
        hit.rcode,
        hit.answers,
        hit.upstream,
        fwd.transport,
        cached=True,
    )
    return Reply(hit.wire, record)
