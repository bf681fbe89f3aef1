"""The resolver's logic without sockets: authority, refusals, forwarding, ech, the cache."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net import _dnsmsg as m
from feos.net import _dnsresolver as r
from feos.net._dnscache import AnswerCache, cache_key
from feos.net._nametable import NameTable


def https_rdata() -> bytes:
    """A real HTTPS record's rdata: alpn, ipv4hint, ech and ipv6hint (RFC 9460 §14.3.2)."""
    params = (
        (1, b"\x02h2"),
        (4, bytes([192, 0, 2, 1])),
        (m.SVC_ECH, b"\x00\x05ECHCF"),
        (6, bytes(16)),
    )
    return m.build_svcb(m.Svcb(1, (), params))


UP = (ipaddress.ip_address("2001:db8:53::1"), ipaddress.ip_address("198.51.100.53"))
TABLES = {
    "web": NameTable.parse(
        "web", 1, {"db": ["2001:db8::5", "10.1.0.5", "2001:db8::6"]}, ("common",)
    ),
    "common": NameTable.parse("common", 1, {"cache": ["10.1.0.9"]}),
}
POD = r.PodDns("a1b2c3d4e5f", ("web",), ())


def query(
    name: str, qtype: int, ident: int = 0x4242, edns: int | None = None, flags: int = m.RD
) -> bytes:
    opt = () if edns is None else (m.Record((), m.OPT, edns, 0, b""),)
    q = (m.Question(tuple(p.encode() for p in name.split(".")), qtype),)
    return m.build_message(m.Message(ident, flags, q, (), (), opt))


def decide(wire: bytes, pod: r.PodDns | None = POD, transport: r.Transport = "udp"):
    return r.decide(wire, "169.254.16.5", pod, TABLES, UP, transport=transport, now=1000.0)


def reply_of(action: object) -> m.Message:
    assert isinstance(action, r.Reply)
    return m.parse_message(action.wire)


def test_held_names_are_answered_with_authority_and_a_ttl_of_5() -> None:
    action = decide(query("DB", m.AAAA))
    msg = reply_of(action)
    assert msg.id == 0x4242
    assert msg.flags & m.AA
    assert msg.flags & m.QR
    assert msg.rcode == m.NOERROR
    assert msg.questions[0].name == (b"DB",)  # the client's spelling comes back
    assert [r.rdata for r in msg.answers] == [
        ipaddress.IPv6Address(a).packed for a in ("2001:db8::5", "2001:db8::6")
    ]
    assert {r.ttl for r in msg.answers} == {5}
    assert action.record.pod == "a1b2c3d4e5f"
    assert action.record.upstream is None
    assert action.record.answers == ("AAAA 2001:db8::5", "AAAA 2001:db8::6")
    a = reply_of(decide(query("db", m.A)))
    assert [x.rdata for x in a.answers] == [bytes([10, 1, 0, 5])]
    assert reply_of(decide(query("cache", m.A))).answers[0].rdata == bytes([10, 1, 0, 9])


@pytest.mark.parametrize("qtype", [m.MX, 16, m.HTTPS, m.ANY])
def test_other_types_of_held_names_get_noerror_without_answers(qtype: int) -> None:
    msg = reply_of(decide(query("db", qtype)))
    assert msg.rcode == m.NOERROR
    assert msg.flags & m.AA
    assert msg.answers == ()


def test_a_held_family_missing_is_noerror_empty() -> None:
    msg = reply_of(decide(query("cache", m.AAAA)))
    assert msg.rcode == m.NOERROR
    assert msg.answers == ()


def test_strangers_are_refused_and_garbage_is_formerr() -> None:
    refused = decide(query("db", m.A), pod=None)
    assert reply_of(refused).rcode == m.REFUSED
    assert refused.record.pod is None
    bad = decide(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x05abc")
    assert reply_of(bad).rcode == m.FORMERR
    assert reply_of(bad).id == 0x1234
    assert isinstance(decide(b"\x00\x01"), r.Drop)
    assert isinstance(decide(query("db", m.A, flags=m.QR)), r.Drop)
    two = m.build_message(m.Message(9, 0, (m.Question((b"a",), 1), m.Question((b"b",), 1))))
    assert reply_of(decide(two)).rcode == m.FORMERR
    assert reply_of(decide(query("db", m.A, flags=2 << 11))).rcode == m.NOTIMP


def test_edns_is_answered_with_edns_and_badvers_for_other_versions() -> None:
    msg = reply_of(decide(query("db", m.A, edns=4096)))
    assert msg.opt() is not None
    assert msg.opt().rclass == r.EDNS_PAYLOAD
    bad = m.build_message(
        m.Message(
            1, 0, (m.Question((b"db",), 1),), (), (), (m.Record((), m.OPT, 1232, 1 << 16, b""),)
        )
    )
    msg = reply_of(decide(bad))
    assert msg.opt().ttl >> 24 == 1  # extended rcode 16 = BADVERS


def test_other_names_go_to_the_pods_upstreams_or_the_nodes() -> None:
    fwd = decide(query("www.example.test", m.A))
    assert isinstance(fwd, r.Forward)
    assert fwd.upstreams == UP
    own = r.PodDns("p", (), (ipaddress.ip_address("192.0.2.53"),))
    assert decide(query("db", m.A), pod=own).upstreams == own.upstreams
    assert isinstance(decide(query("db.svc", m.A)), r.Forward)


def upstream_answer(
    fwd: r.Forward,
    ident: int,
    records: tuple[m.Record, ...],
    flags: int = 0,
    name: m.Name | None = None,
) -> bytes:
    q = fwd.query.questions[0]
    question = m.Question(tuple(x.lower() for x in q.name) if name is None else name, q.qtype)
    return m.build_message(m.Message(ident, m.QR | m.RD | m.RA | flags, (question,), records))


def test_upstream_answers_come_back_with_the_clients_id_and_case() -> None:
    fwd = decide(query("WWW.Example.test", m.A, ident=77))
    sent = r.forward_query(fwd, 999)
    assert sent[:2] == (999).to_bytes(2, "big")
    assert sent[2:] == fwd.wire[2:]
    rec = m.Record((b"www", b"example", b"test"), m.A, 1, 300, bytes([192, 0, 2, 7]))
    wire = upstream_answer(fwd, 999, (rec,))
    assert r.accept_upstream(fwd, 998, UP[0], wire, 0.0) is None  # another ID
    other = upstream_answer(fwd, 999, (rec,), name=(b"evil", b"test"))
    assert r.accept_upstream(fwd, 999, UP[0], other, 0.0) is None
    reply = r.accept_upstream(fwd, 999, UP[0], wire, 1.0)
    assert isinstance(reply, r.Reply)
    msg = m.parse_message(reply.wire)
    assert msg.id == 77
    assert msg.questions[0].name == (b"WWW", b"Example", b"test")
    # Owner names that point at the question take its spelling: names compare without case.
    assert [(tuple(x.lower() for x in a.name), a.ttl, a.rdata) for a in msg.answers] == [
        (rec.name, 300, rec.rdata)
    ]
    assert reply.record.upstream == str(UP[0])
    assert reply.record.answers == ("A 192.0.2.7",)


def test_ech_is_taken_out_of_upstream_https_records() -> None:
    fwd = decide(query("svc.example.test", m.HTTPS, ident=5, edns=1232))
    name = (b"svc", b"example", b"test")
    rec = m.Record(name, m.HTTPS, 1, 60, https_rdata())
    reply = r.accept_upstream(fwd, 3, UP[0], upstream_answer(fwd, 3, (rec,)), 0.0)
    msg = m.parse_message(reply.wire)
    assert msg.id == 5
    assert [k for k, _ in m.parse_svcb(msg.answers[0].rdata).params] == [1, 4, 6]
    assert msg.answers[0].ttl == 60


def test_truncated_answers_are_retried_over_tcp_and_fitted_to_the_client() -> None:
    fwd = decide(query("big.example.test", m.A, ident=5))
    name = (b"big", b"example", b"test")
    assert isinstance(
        r.accept_upstream(fwd, 3, UP[0], upstream_answer(fwd, 3, (), m.TC), 0.0), r.Retry
    )
    many = tuple(m.Record(name, m.A, 1, 60, bytes([192, 0, 2, i])) for i in range(60))
    reply = r.accept_upstream(fwd, 3, UP[0], upstream_answer(fwd, 3, many), 0.0, via_tcp=True)
    msg = m.parse_message(reply.wire)
    assert msg.flags & m.TC
    assert msg.answers == ()
    assert len(reply.wire) <= 512
    tcp = decide(query("big.example.test", m.A, ident=5), transport="tcp")
    reply = r.accept_upstream(tcp, 3, UP[0], upstream_answer(tcp, 3, many), 0.0, via_tcp=True)
    assert len(m.parse_message(reply.wire).answers) == 60


def test_upstream_failure_is_servfail() -> None:
    fwd = decide(query("www.example.test", m.A, ident=5))
    msg = m.parse_message(r.upstream_failure(fwd, 0.0).wire)
    assert msg.rcode == m.SERVFAIL
    assert msg.id == 5


def test_the_cache_lowers_ttls_and_forgets_at_the_shortest() -> None:
    cache = AnswerCache()
    fwd = decide(query("www.example.test", m.A, ident=5))
    name = (b"www", b"example", b"test")
    recs = (m.Record(name, m.A, 1, 30, bytes([192, 0, 2, 7])), m.Record(name, m.A, 1, 10, bytes(4)))
    reply = r.accept_upstream(fwd, 3, UP[0], upstream_answer(fwd, 3, recs), 100.0)
    cache.put(cache_key(fwd), reply.wire, 100.0, str(UP[0]), reply.record.answers)
    again = decide(query("WWW.example.TEST", m.A, ident=6))
    hit = cache.get(cache_key(again), again, 104.5)
    msg = m.parse_message(hit.wire)
    assert msg.id == 6
    assert msg.questions[0].name == (b"WWW", b"example", b"TEST")
    assert [x.ttl for x in msg.answers] == [26, 6]
    assert cache.get(cache_key(again), again, 110.0) is None
    assert len(cache) == 0
    # Other upstreams, or a SERVFAIL, never share an entry.
    cache.put(cache_key(fwd), reply.wire, 100.0, None, ())
    other = decide(query("www.example.test", m.A), pod=r.PodDns("p", (), UP[1:]))
    assert cache.get(cache_key(other), other, 101.0) is None
    cache2 = AnswerCache()
    cache2.put(cache_key(fwd), r.upstream_failure(fwd, 0.0).wire, 0.0, None, ())
    assert len(cache2) == 0


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=300), st.booleans(), st.sampled_from(["udp", "tcp"]))
def test_any_query_bytes_give_an_action(data: bytes, known: bool, transport: r.Transport) -> None:
    action = decide(data, POD if known else None, transport)
    assert isinstance(action, r.Reply | r.Forward | r.Drop)
    if isinstance(action, r.Reply):
        m.parse_message(action.wire)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 0xFFFF))
def test_any_upstream_bytes_are_taken_or_ignored(data: bytes, ident: int) -> None:
    fwd = decide(query("www.example.test", m.A, ident=5))
    # The header of our query makes answers with our question likelier to be explored.
    for wire in (data, (3).to_bytes(2, "big") + b"\x81\x80" + fwd.wire[4:] + data):
        got = r.accept_upstream(fwd, 3, UP[0], wire, 0.0)
        assert got is None or isinstance(got, r.Retry | r.Reply)
        if isinstance(got, r.Reply):
            assert m.parse_message(got.wire).id == 5


def test_a_compressed_question_name_is_formerr() -> None:
    # A pointer into the header parses (to one label here), but the answer is patched at the
    # question's offset: such a query once crashed the server once an upstream answered it.
    wire = bytes.fromhex("0007 0100 0001 0000 0000 0000") + b"\xc0\x05" + bytes.fromhex("00010001")
    assert m.parse_message(wire).questions[0].name == (b"\x00",)
    action = decide(wire)
    assert reply_of(action).rcode == m.FORMERR


def test_answers_with_an_opt_are_not_given_to_clients_without_one() -> None:
    cache = AnswerCache()
    fwd = decide(query("www.example.test", m.A, edns=1232))
    name = (b"www", b"example", b"test")
    rec = m.Record(name, m.A, 1, 30, bytes([192, 0, 2, 7]))
    opt = m.Record((), m.OPT, 1232, 0, b"")
    wire = m.build_message(
        m.Message(3, m.QR | m.RD | m.RA, fwd.query.questions, (rec,), (), (opt,))
    )
    reply = r.accept_upstream(fwd, 3, UP[0], wire, 100.0)
    cache.put(cache_key(fwd), reply.wire, 100.0, str(UP[0]), reply.record.answers)
    plain = decide(query("www.example.test", m.A))
    assert cache.get(cache_key(plain), plain, 101.0) is None
    assert cache.get(cache_key(fwd), fwd, 101.0) is not None
