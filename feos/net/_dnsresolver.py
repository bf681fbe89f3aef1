"""The pods' resolver as pure logic: a query in, what to do with it out.

Theory of operation. `decide` reads a query with what the server knows of its source (the pod it
belongs to, or none) and returns one of three actions:

* Reply: bytes to send back now, and the QueryRecord of it. Strangers get REFUSED, garbage with a
  readable header FORMERR, other opcodes NOTIMP; a one-label name the pod's name tables hold is
  answered with authority (AAAA/A, TTL 5 s, nothing for other types).
* Forward: ask the upstreams in order. The server sends `forward_query(fwd, id)` with an ID of its
  own, gives each answer to `accept_upstream`, which returns None for a datagram that is not the
  answer (keep waiting), Retry for a truncated one (ask again over TCP), or the Reply to send:
  ech taken out of SVCB/HTTPS records, the client's ID and question case restored, and fitted to
  what the client takes over UDP. `upstream_failure` is the SERVFAIL once every upstream failed.
* Drop: nothing can or should be answered (a response, fewer bytes than a header).
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Mapping
from typing import Literal

import attrs

from . import _dnsmsg as m
from ._nametable import Address, NameTable, lookup_name

AUTHORITY_TTL = 5
EDNS_PAYLOAD = 1232  # what we announce and take over UDP ourselves (DNS flag day 2020)
Transport = Literal["udp", "tcp"]


@attrs.frozen
class PodDns:
    """What the resolver needs of a pod: its ID, its name tables in order, its upstreams (empty:
    the node's)."""

    pod_id: str
    name_tables: tuple[str, ...] = ()
    upstreams: tuple[Address, ...] = ()


@attrs.frozen(slots=False)
class QueryRecord:
    """One answered query, for the traffic records (feos.network.v1.TrafficService). Without
    slots: one is made for every query, and a frozen class with slots sets each field through
    object.__setattr__, a third slower than writing its __dict__."""

    time: float
    source: str
    pod: str | None
    name: str
    qtype: int
    rcode: int
    answers: tuple[str, ...]
    upstream: str | None
    transport: Transport
    cached: bool = False


@attrs.frozen
class Reply:
    wire: bytes
    record: QueryRecord


@attrs.frozen
class Drop:
    reason: str


@attrs.frozen
class Retry:
    """The upstream's answer was truncated: ask the same upstream over TCP."""


@attrs.frozen
class Forward:
    query: m.Message
    wire: bytes
    upstreams: tuple[Address, ...]
    source: str
    pod: str
    transport: Transport
    limit: int  # the most the client takes in one answer


def client_limit(query: m.Message, transport: Transport) -> int:
    if transport == "tcp":
        return m.MAX_MESSAGE
    opt = query.opt()
    return 512 if opt is None else max(512, min(opt.rclass, m.MAX_MESSAGE))


def decide(
    wire: bytes,
    source: str,
    pod: PodDns | None,
    tables: Mapping[str, NameTable],
    default_upstreams: tuple[Address, ...],
    *,
    transport: Transport,
    now: float,
) -> Reply | Forward | Drop:
    """What to do with a query from `source` (the pod it is, or None for a stranger)."""
    ident = m.parse_header_id(wire)
    if ident is None:
        return Drop("shorter than a header")
    if int.from_bytes(wire[2:4], "big") & m.QR:
        return Drop("a response, not a query")
    try:
        query = m.parse_message(wire)
    except m.DnsFormatError:
        flags = int.from_bytes(wire[2:4], "big")
        return _reply_bare(ident, flags, m.FORMERR, source, pod, transport, now)
    pod_id = None if pod is None else pod.pod_id
    if query.opcode != 0:
        return _reply(query, m.NOTIMP, (), source, pod_id, transport, now)
    if len(query.questions) != 1 or not _plain_question(wire):
        return _reply(query, m.FORMERR, (), source, pod_id, transport, now)
    if pod is None:
        return _reply(query, m.REFUSED, (), source, None, transport, now)
    opt = query.opt()
    if opt is not None and (opt.ttl >> 16) & 0xFF != 0:
        return _reply(query, m.NOERROR, (), source, pod_id, transport, now, badvers=True)
    question = query.questions[0]
    if question.qclass == m.CLASS_IN and len(question.name) == 1:
        held = lookup_name(question.name[0].decode("latin-1"), pod.name_tables, tables)
        if held is not None:
            return _authority(query, held, source, pod_id, transport, now)
    upstreams = pod.upstreams or default_upstreams
    limit = client_limit(query, transport)
    return Forward(query, wire, upstreams, source, pod.pod_id, transport, limit)


def _authority(
    query: m.Message,
    held: tuple[Address, ...],
    source: str,
    pod: str | None,
    transport: Transport,
    now: float,
) -> Reply:
    question = query.questions[0]
    family = {m.AAAA: ipaddress.IPv6Address, m.A: ipaddress.IPv4Address}.get(question.qtype)
    answers = tuple(
        m.Record(question.name, question.qtype, m.CLASS_IN, AUTHORITY_TTL, a.packed)
        for a in held
        if family is not None and isinstance(a, family)
    )
    return _reply(query, m.NOERROR, answers, source, pod, transport, now, authoritative=True)


def _opt_for(query: m.Message, badvers: bool = False) -> tuple[m.Record, ...]:
    if query.opt() is None:
        return ()
    return (m.Record((), m.OPT, EDNS_PAYLOAD, (1 << 24) if badvers else 0, b""),)


def _reply(
    query: m.Message,
    rcode: int,
    answers: tuple[m.Record, ...],
    source: str,
    pod: str | None,
    transport: Transport,
    now: float,
    *,
    authoritative: bool = False,
    badvers: bool = False,
) -> Reply:
    flags = m.QR | (query.flags & (0x7800 | m.RD)) | m.RA | rcode
    if authoritative:
        flags |= m.AA
    message = m.Message(query.id, flags, query.questions[:1], answers, (), _opt_for(query, badvers))
    wire = _fit(message, client_limit(query, transport))
    question = query.questions[0] if query.questions else None
    record = QueryRecord(
        time=now,
        source=source,
        pod=pod,
        name="" if question is None else m.name_text(question.name),
        qtype=0 if question is None else question.qtype,
        rcode=16 if badvers else rcode,
        answers=tuple(f"{m.type_name(r.rtype)} {m.rdata_text(r.rtype, r.rdata)}" for r in answers),
        upstream=None,
        transport=transport,
    )
    return Reply(wire, record)


def _reply_bare(
    ident: int,
    flags: int,
    rcode: int,
    source: str,
    pod: PodDns | None,
    transport: Transport,
    now: float,
) -> Reply:
    wire = struct.pack("!6H", ident, m.QR | (flags & (0x7800 | m.RD)) | m.RA | rcode, 0, 0, 0, 0)
    pod_id = None if pod is None else pod.pod_id
    record = QueryRecord(now, source, pod_id, "", 0, rcode, (), None, transport)
    return Reply(wire, record)


def _fit(message: m.Message, limit: int) -> bytes:
    """The message, or if it is longer than the client takes, its header and question with TC."""
    wire = m.build_message(message)
    if len(wire) <= limit:
        return wire
    cut = attrs.evolve(
        message,
        flags=message.flags | m.TC,
        answers=(),
        authorities=(),
        additionals=tuple(r for r in message.additionals if r.rtype == m.OPT),
    )
    return m.build_message(cut)


def forward_query(fwd: Forward, ident: int) -> bytes:
    """The query as it goes upstream: the client's bytes, OPT and all, with our ID."""
    return struct.pack("!H", ident) + fwd.wire[2:]


def accept_upstream(
    fwd: Forward, ident: int, upstream: Address, wire: bytes, now: float, *, via_tcp: bool = False
) -> Reply | Retry | None:
    """The client's reply from an upstream's datagram, Retry over TCP, or None if it is not the
    answer to our query (wrong ID or question, unreadable: keep waiting or ask the next)."""
    try:
        answer = m.parse_message(wire)
    except m.DnsFormatError:
        return None
    question = fwd.query.questions[0]
    if (
        answer.id != ident
        or not answer.flags & m.QR
        or len(answer.questions) != 1
        or not _same_question(answer.questions[0], question)
    ):
        return None
    if answer.flags & m.TC and not via_tcp:
        return Retry()
    return finish(fwd, answer, wire, upstream, now)


def finish(
    fwd: Forward,
    answer: m.Message,
    wire: bytes,
    upstream: Address | None,
    now: float,
    *,
    cached: bool = False,
) -> Reply:
    """The client's reply from an upstream's answer: ech out, the client's ID and question back."""
    sections = (answer.answers, answer.authorities, answer.additionals)
    cleaned = [m.without_ech(s) for s in sections]
    patchable = _question_in_place(wire, fwd.wire)
    if any(changed for _, changed in cleaned) or len(wire) > fwd.limit or not patchable:
        answer = attrs.evolve(
            answer,
            id=fwd.query.id,
            questions=fwd.query.questions[:1],
            answers=cleaned[0][0],
            authorities=cleaned[1][0],
            additionals=cleaned[2][0],
        )
        out = _fit(answer, fwd.limit)
    else:
        out = restore_client(wire, fwd.query.id, fwd.wire)
    question = fwd.query.questions[0]
    record = QueryRecord(
        time=now,
        source=fwd.source,
        pod=fwd.pod,
        name=m.name_text(question.name),
        qtype=question.qtype,
        rcode=answer.rcode,
        answers=tuple(
            f"{m.type_name(r.rtype)} {m.rdata_text(r.rtype, r.rdata)}" for r in cleaned[0][0]
        ),
        upstream=None if upstream is None else str(upstream),
        transport=fwd.transport,
        cached=cached,
    )
    return Reply(out, record)


def restore_client(wire: bytes, ident: int, client_query: bytes) -> bytes:
    """An upstream answer with the client's ID and the question's name as the client spelled it
    (0x20 case randomisation), both in place: the question's name stands uncompressed at 12."""
    name_len = _question_name_length(client_query)
    return (
        struct.pack("!H", ident)
        + wire[2:12]
        + client_query[12 : 12 + name_len]
        + wire[12 + name_len :]
    )


def _question_in_place(wire: bytes, client_query: bytes) -> bool:
    """Whether the answer's question name is the client's, uncompressed at offset 12."""
    n = _question_name_length(client_query)
    return wire[12 : 12 + n].lower() == client_query[12 : 12 + n].lower()


def _plain_question(wire: bytes) -> bool:
    """Whether the question's name stands uncompressed at 12, as the answer's patching needs
    (a pointer there could only point into the header: no client sends one)."""
    try:
        m.read_name(wire, 12, compressed=False)
    except m.DnsFormatError:
        return False
    return True


def _question_name_length(wire: bytes) -> int:
    pos = 12
    while wire[pos]:
        pos += 1 + wire[pos]
    return pos + 1 - 12


def _same_question(a: m.Question, b: m.Question) -> bool:
    return (
        a.qtype == b.qtype
        and a.qclass == b.qclass
        and tuple(x.lower() for x in a.name) == tuple(x.lower() for x in b.name)
    )


def upstream_failure(fwd: Forward, now: float) -> Reply:
    """SERVFAIL, once every upstream failed to answer."""
    return _reply(fwd.query, m.SERVFAIL, (), fwd.source, fwd.pod, fwd.transport, now)
