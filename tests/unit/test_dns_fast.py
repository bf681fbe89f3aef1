"""The fast path on raw bytes against the slow path: the same answer and record wherever the fast
path answers, for any bytes, and an answer for the hot case (a plain query the cache holds)."""

from __future__ import annotations

import ipaddress
import struct

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net import _dnsmsg as m
from feos.net import _dnsresolver as r
from feos.net._dnscache import AnswerCache, cache_key
from feos.net._dnsfast import cached_reply, record_fields, slow_cached_reply
from feos.net._nametable import NameTable

UP = (ipaddress.ip_address("198.51.100.53"),)
OWN = (ipaddress.ip_address("192.0.2.53"),)
TABLES = {"web": NameTable.parse("web", 1, {"db": ["10.1.0.5"]})}
POD = r.PodDns("a1b2c3d4e5f", ("web",), ())
PLAIN_POD = r.PodDns("p", (), ())  # no name tables: the same upstreams as POD
OWN_POD = r.PodDns("f5e4d3c2b1a", ("web",), OWN)
SOURCE = "169.254.16.5"
NAMES = ("www.example.test", "Mixed.Case.test", "a.b", "www.example.test", "", "db", "x")


def query(
    name: str,
    qtype: int = m.A,
    ident: int = 0x4242,
    flags: int = m.RD,
    opt: tuple[int, int, bytes] | None = None,  # payload, the TTL field (version, DO), rdata
) -> bytes:
    additionals = () if opt is None else (m.Record((), m.OPT, opt[0], opt[1], opt[2]),)
    q = (m.Question(tuple(p.encode() for p in name.split(".") if p), qtype),)
    return m.build_message(m.Message(ident, flags, q, (), (), additionals))


def answer_of(fwd: r.Forward, ttls: list[int], extra: int) -> r.Reply | None:
    """The slow path's reply to `fwd` from an upstream: len(ttls) records of 4 bytes and `extra`
    more (None where the question's type cannot hold 4 bytes: one with a name in its rdata)."""
    q = fwd.query.questions[0]
    name = tuple(x.lower() for x in q.name)
    records = tuple(
        m.Record(name, q.qtype, 1, ttl, bytes([192, 0, 2, i % 256]))
        for i, ttl in enumerate(ttls + [300] * extra)
    )
    opt = () if fwd.query.opt() is None else (m.Record((), m.OPT, 1232, 0, b""),)
    question = m.Question(name, q.qtype, q.qclass)
    wire = m.build_message(m.Message(7, m.QR | m.RD | m.RA, (question,), records, (), opt))
    reply = r.accept_upstream(fwd, 7, fwd.upstreams[0], wire, 0.0, via_tcp=True)
    assert reply is None or isinstance(reply, r.Reply)
    return reply


def caches_holding(stored: bytes, pod: r.PodDns, ttls: list[int], extra: int) -> list[AnswerCache]:
    """Two caches alike, holding the answer to `stored` if the slow path would forward it."""
    caches = [AnswerCache(), AnswerCache()]
    fwd = r.decide(stored, SOURCE, pod, TABLES, UP, transport="tcp", now=100.0)
    reply = answer_of(fwd, ttls, extra) if isinstance(fwd, r.Forward) else None
    if isinstance(fwd, r.Forward) and reply is not None:
        for cache in caches:
            cache.put(
                cache_key(fwd), reply.wire, 100.0, str(fwd.upstreams[0]), reply.record.answers
            )
    return caches


def both_paths(
    data: bytes, pod: r.PodDns | None, caches: list[AnswerCache], now: float, transport: r.Transport
) -> tuple[tuple[bytes, r.QueryRecord] | None, r.Reply | r.Forward | r.Drop]:
    fast = cached_reply(data, SOURCE, pod, UP, caches[0], now, transport)
    slow = r.decide(data, SOURCE, pod, TABLES, UP, transport=transport, now=now)
    if isinstance(slow, r.Forward):
        slow = slow_cached_reply(slow, caches[1], now) or slow
    return fast, slow


def check_same(
    data: bytes, pod: r.PodDns | None, caches: list[AnswerCache], now: float, transport: r.Transport
) -> bool:
    """Whether the fast path answered; where it did, the slow path answers alike."""
    fast, slow = both_paths(data, pod, caches, now, transport)
    if fast is None:
        return False
    assert isinstance(slow, r.Reply)
    assert fast == (slow.wire, slow.record)
    assert list(caches[0]._entries) == list(caches[1]._entries)  # the same entries, same order
    return True


def test_a_plain_query_the_cache_holds_takes_the_fast_path() -> None:
    stored = query("www.example.test", ident=1)
    caches = caches_holding(stored, POD, [30, 10], 0)
    asked = query("WWW.Example.test", ident=0xBEEF)
    fast, _ = both_paths(asked, POD, caches, 104.5, "udp")
    assert fast is not None
    msg = m.parse_message(fast[0])
    assert msg.id == 0xBEEF
    assert msg.questions[0].name == (b"WWW", b"Example", b"test")
    assert [a.ttl for a in msg.answers] == [26, 6]
    assert fast[1].cached and fast[1].name == "WWW.Example.test."
    assert check_same(asked, POD, caches, 104.5, "udp")
    assert check_same(asked, POD, caches, 105.2, "tcp")  # aged once more: the copy is made again
    assert check_same(query("www.example.test", opt=None), POD, caches, 109.0, "udp")


def test_what_the_fast_path_leaves_to_the_slow_one() -> None:
    stored = query("www.example.test")
    caches = caches_holding(stored, POD, [30], 0)
    assert check_same(stored, POD, caches, 101.0, "udp")
    for other in (
        query("www.example.test", opt=(1232, 0, b"")),  # the key has the OPT: no entry
        query("www.example.test", flags=0),  # nor without RD
        query("www.example.test", flags=m.RD | 1 << 11),  # another opcode: NOTIMP
        query("www.example.test", flags=m.QR),  # a response: dropped
        query("www.example.test", qtype=m.AAAA),
        stored[:2] + b"\x01\x00\x00\x01\x00\x00\x00\x01\x00\x00" + stored[12:],  # a claimed NS
    ):
        assert cached_reply(other, SOURCE, POD, UP, caches[0], 101.0) is None
    assert cached_reply(stored, SOURCE, None, UP, caches[0], 101.0) is None  # a stranger
    assert cached_reply(stored, SOURCE, OWN_POD, UP, caches[0], 101.0) is None  # other upstreams
    assert cached_reply(stored, SOURCE, POD, UP, caches[0], 130.0) is None  # expired
    assert len(caches[0]) == 0


def test_one_label_names_are_the_name_tables_first() -> None:
    stored = query("db", qtype=m.A)
    caches = caches_holding(stored, PLAIN_POD, [60], 0)
    assert len(caches[0]) == 1
    assert cached_reply(stored, SOURCE, POD, UP, caches[0], 101.0) is None
    fast, slow = both_paths(stored, POD, caches, 101.0, "udp")
    assert fast is None
    assert isinstance(slow, r.Reply) and slow.record.upstream is None  # the table's answer


def test_answers_longer_than_the_client_takes_go_upstream_again() -> None:
    stored = query("www.example.test", opt=(4096, 0, b""))
    caches = caches_holding(stored, POD, [60], 60)  # 61 records: more than 512 bytes
    assert check_same(stored, POD, caches, 101.0, "udp")
    small = query("www.example.test", opt=(512, 0, b""))
    assert cached_reply(small, SOURCE, POD, UP, caches[0], 101.0) is None
    assert check_same(small, POD, caches, 101.0, "tcp")


def test_edns_versions_other_than_0_and_do_are_their_own_cases() -> None:
    stored = query("www.example.test", opt=(1232, 0, b""))
    caches = caches_holding(stored, POD, [60], 0)
    assert (
        cached_reply(
            query("www.example.test", opt=(1232, 1 << 16, b"")), SOURCE, POD, UP, caches[0], 101.0
        )
        is None
    )
    assert (
        cached_reply(
            query("www.example.test", opt=(1232, 0x8000, b"")), SOURCE, POD, UP, caches[0], 101.0
        )
        is None
    )
    assert check_same(
        query("www.example.test", opt=(1232, 0, b"\x00\x0a\x00\x08cookie!!")),
        POD,
        caches,
        101.0,
        "udp",
    )


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300), st.booleans(), st.sampled_from(["udp", "tcp"]))
def test_any_bytes_take_the_fast_path_only_to_the_slow_paths_answer(
    data: bytes, known: bool, transport: r.Transport
) -> None:
    # A cache holding the answer to the bytes' question, where they have one, makes a hit likely.
    caches = caches_holding(data, POD, [60], 0)
    check_same(data, POD if known else None, caches, 101.0, transport)


def spelled(name: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda up: "".join(c.upper() if u else c for c, u in zip(name, up, strict=True))
    )


qtypes = st.sampled_from([m.A, m.A, m.AAAA, m.AAAA, 0, m.HTTPS, m.MX, m.OPT])
header_flags = st.sampled_from(
    [m.RD, m.RD, 0, m.RD | 0x0010, m.RD | 0x0020, m.RD | m.TC, m.RD | 1 << 11, m.QR]
)
opts = st.none() | st.tuples(
    st.sampled_from([0, 512, 1232, 4096, 65535]),
    st.sampled_from([0, 0, 0x8000, 0x8000, 1 << 16, 1 << 24, 0x7FFF]),
    st.sampled_from([b"", b"\x00\x0a\x00\x08cookie!!", b"\x00\x0a\x00"]),
)
FIELDS = (qtypes, header_flags, opts)


@st.composite
def query_pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A query whose answer is kept and one asked later: the same but for the ID and the name's
    case, and each of its type, flags, OPT drawn again at times."""
    name = draw(st.sampled_from(NAMES))
    params = [draw(field) for field in FIELDS]
    stored = query(draw(spelled(name)), params[0], draw(st.integers(0, 0xFFFF)), *params[1:])
    for i, field in enumerate(FIELDS):
        if draw(st.integers(0, 2)) == 0:
            params[i] = draw(field)
    asked = query(draw(spelled(name)), params[0], draw(st.integers(0, 0xFFFF)), *params[1:])
    return stored, asked


@settings(max_examples=800, deadline=None)
@given(
    query_pairs(),
    st.lists(st.integers(0, 600), min_size=1, max_size=3),
    st.integers(0, 40),
    st.floats(99.0, 200.0),
    st.sampled_from(["udp", "tcp"]),
    st.sampled_from([POD, POD, OWN_POD]),
    st.binary(max_size=3),
    st.none() | st.none() | st.tuples(st.integers(0, 80), st.integers(0, 255)),
)
def test_queries_like_the_cached_one_give_the_slow_paths_answer(
    pair: tuple[bytes, bytes],
    ttls: list[int],
    extra: int,
    now: float,
    transport: r.Transport,
    pod: r.PodDns,
    tail: bytes,
    flip: tuple[int, int] | None,
) -> None:
    stored, asked = pair
    caches = caches_holding(stored, PLAIN_POD, ttls, extra)  # one-label names too
    data = bytearray(asked + tail)
    if flip is not None and flip[0] < len(data):
        data[flip[0]] = flip[1]  # one byte changed: a header flag, a length, a type
    check_same(bytes(data), pod, caches, now, transport)
    check_same(stored, POD, caches, now, transport)  # the stored one itself hits, if not expired


def test_a_question_name_of_255_bytes_is_the_longest() -> None:
    longest = ".".join(["a" * 63] * 3 + ["b" * 61])  # 3 * 64 + 62 + the root: 255 bytes
    stored = query(longest)
    caches = caches_holding(stored, POD, [60], 0)
    assert check_same(stored, POD, caches, 101.0, "udp")
    too_long = bytearray(stored)
    too_long[12 + 3 * 64] = 62  # the last label a byte longer, the root and the type shifted
    too_long[12 + 3 * 64 + 1 : 12 + 3 * 64 + 1] = b"b"
    assert cached_reply(bytes(too_long), SOURCE, POD, UP, caches[0], 101.0) is None
    assert isinstance(
        r.decide(bytes(too_long), SOURCE, POD, TABLES, UP, transport="udp", now=0.0), r.Reply
    )  # FORMERR from the slow path
    assert struct.unpack_from("!H", stored, len(stored) - 4)[0] == m.A


def test_a_record_from_its_fields_is_the_one_attrs_makes() -> None:
    # The batch's records are a copy of record_fields given to a new object's __dict__
    # (_dnsfast.records): every field attrs knows, none more, and the same record.
    stored = query("www.example.test")
    caches = caches_holding(stored, POD, [30], 0)
    fast = cached_reply(stored, SOURCE, POD, UP, caches[0], 101.0)
    assert fast is not None
    entry = next(iter(caches[0]._entries.values()))
    fields = record_fields("www.example.test.", m.A, entry)
    assert list(fields) == [f.name for f in attrs.fields(r.QueryRecord)]
    fields.update(time=101.0, source=SOURCE, pod=POD.pod_id)
    made = object.__new__(r.QueryRecord)
    object.__setattr__(made, "__dict__", fields)
    assert made == fast[1] == r.QueryRecord(**fields)  # type: ignore[arg-type]
    assert made.__dict__ == r.QueryRecord(**fields).__dict__  # type: ignore[arg-type]
