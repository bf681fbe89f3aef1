"""The DNS codec (feos.net._dnsmsg) held to dnspython, an independent reader and writer.

What dnspython builds (names compressed wherever it compresses them: owners, questions, and the
names in NS, CNAME, PTR, MX and SOA rdata) parses through ours to the same message, its TTL
offsets included; what ours builds (owner and question names compressed) dnspython reads to the
same message; SVCB/HTTPS rdata reads as dnspython writes it. Damaged messages (dnspython's,
bytes changed) parse or raise DnsFormatError, nothing else, and what dnspython takes of them
ours takes too, to the same question and header.
"""

from __future__ import annotations

from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net import _dnsmsg as ours
from feos.net._dnsmsg import DnsFormatError, Message, Question, Record

# Names: labels drawn from a few so that suffixes repeat and compression has work to do.
labels = st.one_of(st.sampled_from([b"www", b"example", b"com", b"a", b"mail", b"Example"]),
                   st.binary(min_size=1, max_size=10))  # fmt: skip
names = st.lists(labels, min_size=0, max_size=4).map(tuple).filter(
    lambda n: sum(len(x) + 1 for x in n) < 255
)


def _dn(name: tuple[bytes, ...]) -> dns.name.Name:
    return dns.name.Name([*name, b""])


def _ours_name(name: dns.name.Name) -> tuple[bytes, ...]:
    return tuple(name.labels[:-1])


def _text(name: tuple[bytes, ...]) -> str:
    return _dn(name).to_text()


ttls = st.integers(0, 2**31 - 1)
# (rdtype, text of its rdata) for the types with names in their rdata and a few without
rdatas = st.one_of(
    st.tuples(st.just("A"), st.ip_addresses(v=4).map(str)),
    st.tuples(st.just("AAAA"), st.ip_addresses(v=6).map(str)),
    st.tuples(st.sampled_from(["NS", "CNAME", "PTR", "DNAME"]), names.map(_text)),
    st.tuples(st.just("MX"), st.tuples(st.integers(0, 65535), names).map(
        lambda p: f"{p[0]} {_text(p[1])}")),
    st.tuples(st.just("SRV"), st.tuples(st.integers(0, 65535), names).map(
        lambda p: f"{p[0]} 5 443 {_text(p[1])}")),
    st.tuples(st.just("SOA"), st.tuples(names, names, st.integers(0, 2**32 - 1)).map(
        lambda p: f"{_text(p[0])} {_text(p[1])} {p[2]} 7200 900 1209600 300")),
    st.tuples(st.just("TXT"), st.lists(st.text("abc xyz\"", max_size=20), min_size=1,
                                       max_size=3).map(lambda t: " ".join(
                                           '"' + s.replace('"', '\\"') + '"' for s in t))),
    st.tuples(st.just("HTTPS"), st.sampled_from([
        '1 . alpn="h2,h3" port=443', '0 svc.example.', '2 . key667=hello ipv4hint=192.0.2.1',
        '1 . mandatory=alpn alpn=h2 no-default-alpn ipv6hint=2001:db8::1'])),
    st.tuples(st.just("TYPE65280"), st.binary(max_size=30).map(
        lambda b: f"\\# {len(b)} {b.hex()}" if b else "\\# 0")),
)  # fmt: skip
records = st.tuples(names, rdatas, ttls)
# dnspython reads records of one name and type in a section as one rrset: none such here
sections = st.lists(records, max_size=4,
                    unique_by=lambda r: (tuple(x.lower() for x in r[0]), r[1][0]))


def _dns_message(ident: int, questions: list[Any], answers: list[Any], authority: list[Any],
                 additional: list[Any], edns: Any) -> dns.message.Message:  # fmt: skip
    msg = dns.message.Message(id=ident)
    msg.flags = dns.flags.QR | dns.flags.RD
    for name, qtype in questions:
        msg.find_rrset(msg.question, _dn(name), dns.rdataclass.IN, qtype, create=True)
    for section, items in ((msg.answer, answers), (msg.authority, authority),
                           (msg.additional, additional)):  # fmt: skip
        for name, (rtype, text), ttl in items:
            rdtype = dns.rdatatype.from_text(rtype)
            rd = dns.rdata.from_text(dns.rdataclass.IN, rdtype, text)
            rrset = dns.rrset.RRset(_dn(name), dns.rdataclass.IN, rdtype)
            rrset.add(rd, ttl)
            section.append(rrset)
    if edns is not None:
        payload, options = edns
        msg.use_edns(0, 0, payload, options=[dns.edns.GenericOption(65001, v) for v in options])
    return msg


def _expected(msg: dns.message.Message) -> Message:
    """dnspython's message in our model (OPT last among the additionals, as it writes it)."""
    def flat(section: Any) -> tuple[Record, ...]:
        return tuple(Record(_ours_name(rrset.name), rrset.rdtype, rrset.rdclass, rrset.ttl,
                            rd.to_wire()) for rrset in section for rd in rrset)  # fmt: skip

    additional = flat(msg.additional)
    if msg.opt is not None:
        opt = msg.opt
        additional += tuple(Record((), ours.OPT, opt.rdclass, opt.ttl, rd.to_wire()) for rd in opt)
    questions = tuple(Question(_ours_name(q.name), q.rdtype, q.rdclass) for q in msg.question)
    return Message(msg.id, msg.flags, questions, flat(msg.answer), flat(msg.authority),
                   additional)  # fmt: skip


def _norm(message: Message) -> Message:
    """The message with every name in lower case, rdata in dnspython's canonical form: dnspython
    compresses without regard to case (a name may come back in the case of the one it points
    to), as DNS allows; ours keeps the bytes it reads."""

    def name(n: tuple[bytes, ...]) -> tuple[bytes, ...]:
        return tuple(x.lower() for x in n)

    def record(r: Record) -> Record:
        rdata = r.rdata
        if r.rtype != ours.OPT:
            rdata = dns.rdata.from_wire(r.rclass, r.rtype, r.rdata, 0, len(r.rdata)).to_digestable()
        return Record(name(r.name), int(r.rtype), int(r.rclass), r.ttl, rdata)

    return Message(message.id, message.flags,
                   tuple(Question(name(q.name), int(q.qtype), int(q.qclass))
                         for q in message.questions),
                   *(tuple(record(r) for r in section) for section in
                     (message.answers, message.authorities, message.additionals)))  # fmt: skip


questions = st.lists(st.tuples(names, st.sampled_from([1, 28, 65, 255, 16, 5])), max_size=2,
                     unique_by=lambda q: (tuple(x.lower() for x in q[0]), q[1]))  # fmt: skip
edns = st.none() | st.tuples(st.integers(512, 65535), st.lists(st.binary(max_size=8), max_size=2))
messages = st.builds(_dns_message, st.integers(0, 65535), questions, sections, sections,
                     sections, edns)  # fmt: skip


@given(messages)
@settings(max_examples=400, deadline=None)
def test_what_dnspython_builds_parses_the_same(msg: dns.message.Message) -> None:
    wire = msg.to_wire(max_size=65535)
    got = ours.parse_message(wire)
    assert _norm(got) == _norm(_expected(msg))
    ttl = [r.ttl for section in (got.answers, got.authorities, got.additionals) for r in section
           if r.rtype != ours.OPT]  # fmt: skip
    assert [t for _, t in ours.ttl_offsets(wire)] == ttl


@given(messages)
@settings(max_examples=200, deadline=None)
def test_what_ours_builds_dnspython_reads_the_same(msg: dns.message.Message) -> None:
    # Ours builds the message dnspython made, and dnspython reads it back to the same (its
    # rrsets merge records of one name and type: the strategy makes none such within a section).
    ours_message = _expected(msg)
    wire = ours.build_message(ours_message)
    assert _expected(dns.message.from_wire(wire)) == ours_message


def test_compression_pointers_are_followed_as_dnspython_writes_them() -> None:
    msg = _dns_message(7, [((b"www", b"example", b"com"), 1)],
                       [((b"www", b"example", b"com"), ("CNAME", "mail.example.com."), 60),
                        ((b"mail", b"example", b"com"), ("MX", "10 example.com."), 60),
                        ((b"example", b"com"), ("SOA", "ns.example.com. h.example.com. 1 2 3 4 5"),
                         60)], [], [], None)  # fmt: skip
    wire = msg.to_wire(max_size=65535)
    assert wire.count(b"\xc0") >= 4  # names in owners and rdata point back
    got = ours.parse_message(wire)
    assert _norm(got) == _norm(_expected(msg))
    assert ours.build_message(got) != wire  # ours writes rdata names whole ...
    assert dns.message.from_wire(ours.build_message(got)) == msg  # ... which dnspython reads


@given(st.sampled_from([
    '1 . alpn="h2,h3" port=443', '0 svc.example.', '2 . key667=hello ipv4hint=192.0.2.1',
    '1 . mandatory=alpn alpn=h2 no-default-alpn ipv6hint=2001:db8::1']))  # fmt: skip
def test_svcb_reads_as_dnspython_writes_it(text: str) -> None:
    rd = dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.HTTPS, text)
    svcb = ours.parse_svcb(rd.to_wire())
    assert (svcb.priority, svcb.target) == (rd.priority, _ours_name(rd.target))
    assert [k for k, _ in svcb.params] == sorted(int(k) for k in rd.params)
    back = dns.rdata.from_wire(dns.rdataclass.IN, dns.rdatatype.HTTPS, ours.build_svcb(svcb), 0,
                               len(ours.build_svcb(svcb)))  # fmt: skip
    assert back == rd


damages = st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255),
                             st.sampled_from(["set", "insert", "delete", "cut"])),
                   min_size=1, max_size=3)  # fmt: skip


def _damage(wire: bytes, ops: list[tuple[int, int, str]]) -> bytes:
    buf = bytearray(wire)
    for at, value, kind in ops:
        if not buf:
            break
        at %= len(buf)
        if kind == "set":
            buf[at] = value
        elif kind == "insert":
            buf[at:at] = bytes([value])
        elif kind == "delete":
            del buf[at]
        else:
            del buf[at:]
    return bytes(buf)


@given(messages, damages)
@settings(max_examples=600, deadline=None)
def test_damaged_messages_raise_the_format_error_or_parse_as_dnspython_does(
    msg: dns.message.Message, ops: list[tuple[int, int, str]]
) -> None:
    wire = _damage(msg.to_wire(max_size=65535), ops)
    try:
        got: Message | None = ours.parse_message(wire)
    except DnsFormatError as e:
        got, why = None, str(e)
    try:
        theirs = dns.message.from_wire(wire)
    except Exception:  # dnspython refuses far more: bad rdata of the types it knows, ...
        return
    if got is None and _opaque_to_dnspython(theirs):
        return  # a type whose rdata names ours reads (RFC 3597 §4: MD, MB, ...), dnspython not
    assert got is not None, f"dnspython reads a message ours refuses ({why}): {wire.hex()}"
    assert (got.id, got.flags & 0xFFF0) == (theirs.id, theirs.flags & 0xFFF0)
    assert [(q.name, q.qtype, q.qclass) for q in got.questions] == [
        (_ours_name(q.name), q.rdtype, q.rdclass) for q in theirs.question]


def _opaque_to_dnspython(msg: dns.message.Message) -> bool:
    return any(rrset.rdtype in ours._NAMED_RDATA and isinstance(rd, dns.rdata.GenericRdata)
               for section in (msg.answer, msg.authority, msg.additional)
               for rrset in section for rd in rrset)  # fmt: skip


@pytest.mark.parametrize("wire", [
    b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01",  # a loop
    b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x20\x00\x01\x00\x01",  # forward
    b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x40\x00\x00\x01\x00\x01",  # ext label
    b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03www",  # cut
])  # fmt: skip
def test_what_dnspython_refuses_ours_refuses(wire: bytes) -> None:
    with pytest.raises(dns.exception.DNSException):
        dns.message.from_wire(wire)
    with pytest.raises(DnsFormatError):
        ours.parse_message(wire)
