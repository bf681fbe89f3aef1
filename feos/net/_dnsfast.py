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

What a query's bytes after its ID give is kept (a _Hot, by those bytes: pods repeat their
queries): the scan, the key for the upstreams last asked, and the answer made for the query's
spelling from the entry last found, for as long as that entry keeps its age. `answer_batch` does
for a batch that recvmmsg read what `cached_reply` does for one query (tests/kernel/
test_dns_mmsg.py holds them to the same answers, records and LRU order), with no Python object
made per query but its record: it checks the kept entry is still the cache's and of the same
age, and has the batch copy the query's own ID and the kept answer's bytes into its own memory
(_dnsmmsg, feos.native.DatagramBatch.reply). What is kept here is Python objects only: nothing
the kernel reads at the flush lies in them, so dropping them (the table's clear, a new entry)
can never change an answer already queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _dnsmmsg
from ._dnscache import (
    KEY_DO,
    KEY_EDNS,
    KEY_FLAGS,
    AnswerCache,
    Key,
    _Entry,
    cache_key,
    make_key,
)
from ._dnsmsg import MAX_MESSAGE, name_text
from ._dnsresolver import Forward, PodDns, QueryRecord, Reply, Transport
from ._nametable import Address

_ONE_QUESTION = b"\x00\x01\x00\x00\x00\x00\x00\x00"  # qd an ns ar: 1 0 0 0
_ONE_QUESTION_OPT = b"\x00\x01\x00\x00\x00\x00\x00\x01"  # and one additional: the OPT
_OPT_HEAD = b"\x00\x00\x29"  # the root name, type 41
_HOT_KEPT = 4096
_SCANNED_AT_MOST = 512  # bytes of a query whose scan is kept: at most 2 MB of queries kept
_TAILS_AT_MOST = 16 << 20  # bytes of answers made for the kept queries before they are let go


class _Hot:
    """What the fast path keeps of one query's bytes after its ID (pods repeat their queries):
    the scan, the cache key for the upstreams it was last asked for, and the answer made for its
    spelling from the entry it was last answered from, at that entry's age."""

    __slots__ = (
        "aged_for",
        "bits",
        "entry",
        "fields",
        "key",
        "limit",
        "lower",
        "qtype_class",
        "since",
        "size",
        "spelled",
        "tail",
        "text",
        "until",
        "upstreams",
    )

    def __init__(self, limit: int, qtype_class: int, bits: int, spelled: bytes, text: str) -> None:
        self.limit = limit  # the most the client takes over UDP
        self.qtype_class = qtype_class  # qtype << 16 | qclass
        self.bits = bits  # the key's bits: RD, CD, KEY_EDNS, KEY_DO
        self.lower = spelled.lower()  # the question's name in wire form, as the key has it
        self.spelled = spelled  # ... and as the client spelled it
        self.text = text  # ... as records give it
        self.upstreams: tuple[Address, ...] | None = None
        self.key: Key = b""
        self.entry: _Entry | None = None
        self.aged_for = -1
        self.tail = b""  # the answer after its ID: entry.aged with the client's spelling
        self.size = 0  # the whole answer's length, its ID included
        self.fields: dict[str, object] = {}  # a record of an answer from entry, but its time,
        # source and pod: `records` copies it (a dict's copy costs half of attrs' __init__)
        # The times at which the tail is the answer over UDP, [since, until): those at which
        # int(now - entry.stored) == aged_for and now >= entry.stored, which is exact (the
        # difference of two times within a factor of 2 of each other is a float without
        # rounding, and so is stored plus a small integer); empty if the answer is too long.
        self.since = self.until = 0.0


_hot: dict[bytes, _Hot | None] = {}  # by the query's bytes after its ID; None: the slow path's
_tail_bytes = 0
_UNSEEN = _Hot(0, 0, 0, b"", "")
_UNKNOWN = PodDns("")  # a source not looked up yet in this batch
_SET = object.__setattr__  # QueryRecord is frozen


def cached_reply(
    data: bytes,
    source: str,
    pod: PodDns | None,
    default_upstreams: tuple[Address, ...],
    cache: AnswerCache,
    now: float,
    transport: Transport = "udp",
) -> tuple[bytes, QueryRecord] | None:
    """The answer from the cache and its record, or None: the slow path decides. One query at
    a time; `answer_batch` is the same for a batch that recvmmsg read."""
    if pod is None:
        return None
    after_id = data[2:]
    hot = _hot.get(after_id, _UNSEEN)
    if hot is _UNSEEN:
        hot = _learn(data)
    if hot is None:
        return None
    upstreams = pod.upstreams or default_upstreams
    if hot.upstreams is not upstreams:
        _bind(hot, upstreams)
    entry = _refresh(hot, cache, now, hot.limit if transport == "udp" else MAX_MESSAGE)
    if entry is None:
        return None
    return data[:2] + hot.tail, _record(hot, entry, now, source, pod.pod_id, transport)


def answer_batch(
    batcher: _dnsmmsg.Batcher,
    count: int,
    now: float,
    pod_of: Callable[[str], PodDns | None],
    default_upstreams: tuple[Address, ...],
    cache: AnswerCache,
    slow: Callable[[int, PodDns | None, list[Any]], None],
    done: list[Any],
) -> None:
    """Answer the `count` datagrams the batcher read: what the cache holds is queued here (its
    ID from the query's own bytes, the rest from the kept answer, copied into the batch by the
    call that queues it), the rest goes to `slow(i, pod, done)`, which queues its answer and
    appends its record. For each hit `done` gets a tuple that `records` turns into its
    QueryRecord once the batch is sent. The same answers as `cached_reply`, query by query
    (tests/kernel/test_dns_mmsg.py); the hot loop, so what it calls is bound to locals."""
    data, at, lengths, addrs, reply = (
        batcher.data, batcher.data_at, batcher.lengths, batcher.addrs, batcher.reply
    )  # fmt: skip
    memo, peek, touch, append = _hot, cache.peek, cache.touch, done.append
    pods: dict[int, PodDns | None] = {}  # a source's pod, looked up once per batch
    slot = _dnsmmsg.SLOT
    for i in range(count):
        start = at + i * slot
        end = start + lengths[i]
        addr = addrs[i]
        pod = pods.get(addr, _UNKNOWN)
        if pod is _UNKNOWN:
            pod = pods[addr] = pod_of(batcher.source(addr))
        hot = memo.get(data[start + 2 : end], _UNSEEN)
        if hot is _UNSEEN:
            hot = _learn(data[start:end])
        if hot is not None and pod is not None:
            upstreams = pod.upstreams or default_upstreams
            if hot.upstreams is not upstreams:
                _bind(hot, upstreams)
            if peek(hot.key) is hot.entry and hot.since <= now < hot.until:
                entry = hot.entry
                touch(hot.key)  # what _refresh would find: the answer made is still the one
            else:
                entry = _refresh(hot, cache, now, hot.limit)
            if entry is not None:
                reply(i, hot.tail)  # the query's ID and the tail, copied now
                append((hot.fields, pod.pod_id, addr))
                continue
        slow(i, pod, done)


def records(
    done: list[Any], now: float, batcher: _dnsmmsg.Batcher
) -> tuple[list[QueryRecord], int]:
    """The records of a batch from what `answer_batch` and its slow path left in `done`, in
    the order of the queries; and how many of them the hot path answered."""
    out: list[QueryRecord] = []
    append, hits, sources, new, put = out.append, 0, batcher.sources, object.__new__, _SET
    for item in done:
        if item.__class__ is tuple:
            fields, pod_id, addr = item
            hits += 1
            fields = fields.copy()
            fields["time"], fields["pod"] = now, pod_id
            fields["source"] = sources.get(addr) or batcher.source(addr)
            item = new(QueryRecord)
            put(item, "__dict__", fields)  # what QueryRecord(**fields) makes (test_dns_fast)
        append(item)
    return out, hits


def _learn(data: bytes) -> _Hot | None:
    """The hot item of a query not seen lately (kept if the query is short), or None."""
    scan = _scan(data)
    hot = None if scan is None else _Hot(*scan)
    if len(data) <= _SCANNED_AT_MOST:
        if len(_hot) >= _HOT_KEPT:
            _hot.clear()
        _hot[data[2:]] = hot
    return hot


def _bind(hot: _Hot, upstreams: tuple[Address, ...]) -> None:
    """The key for these upstreams (pods with the same upstreams share the tuple)."""
    hot.upstreams = upstreams
    hot.key = make_key(upstreams, hot.lower, hot.qtype_class, hot.bits)
    hot.entry, hot.since, hot.until = None, 0.0, 0.0


def _refresh(hot: _Hot, cache: AnswerCache, now: float, limit: int) -> _Entry | None:
    """The cache's entry for the hot item's key now, and its answer made for the item's
    spelling if the entry or its age changed; None where the cache has no answer."""
    global _tail_bytes
    entry = cache.fresh(hot.key, now, limit)
    if entry is None:
        return None
    if entry is not hot.entry or entry.aged_for != hot.aged_for:
        aged, n = entry.aged, len(hot.spelled)
        hot.tail = aged[2:12] + hot.spelled + aged[12 + n :]
        hot.entry, hot.aged_for, hot.size = entry, entry.aged_for, len(aged)
        hot.fields = record_fields(hot.text, hot.qtype_class >> 16, entry)
        hot.since = hot.until = 0.0
        if hot.size <= hot.limit:
            hot.since = entry.stored + entry.aged_for
            hot.until = hot.since + 1  # aged_for < lifetime: not past the entry's end
        _tail_bytes += hot.size
        if _tail_bytes > _TAILS_AT_MOST:
            _tail_bytes = 0
            _hot.clear()  # a bound on what answers the kept queries hold: made again as needed
    return entry


def record_fields(name: str, qtype: int, entry: _Entry) -> dict[str, object]:
    """A QueryRecord's fields for a cached answer over UDP, but for its time, source and pod."""
    return {
        "time": 0.0,
        "source": "",
        "pod": None,
        "name": name,
        "qtype": qtype,
        "rcode": entry.rcode,
        "answers": entry.answers,
        "upstream": entry.upstream,
        "transport": "udp",
        "cached": True,
    }


def _record(
    hot: _Hot, entry: _Entry, now: float, source: str, pod_id: str, transport: Transport
) -> QueryRecord:
    return QueryRecord(
        now,
        source,
        pod_id,
        hot.text,
        hot.qtype_class >> 16,
        entry.rcode,
        entry.answers,
        entry.upstream,
        transport,
        True,
    )


def _scan(data: bytes) -> tuple[int, int, int, bytes, str] | None:
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
    return limit, qtype_class, bits, name, _name_text(name)


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
