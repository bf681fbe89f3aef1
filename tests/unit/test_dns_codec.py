"""The DNS codec: round trips, compression, SVCB/HTTPS rdata, and any bytes parsed safely."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net import _dnsmsg as m


def https_rdata(ech: bytes | None = b"\x00\x45ECHCONFIG") -> bytes:
    params = [(1, b"\x02h2\x02h3"), (4, bytes([192, 0, 2, 1]))]
    if ech is not None:
        params.append((m.SVC_ECH, ech))
    params.append((6, bytes(16)))
    return m.build_svcb(m.Svcb(1, (), tuple(params)))


def test_round_trip_keeps_every_section() -> None:
    name = m.name_from_text("www.example.test")
    msg = m.Message(
        0x1234,
        m.QR | m.RD | m.RA,
        (m.Question(name, m.AAAA),),
        (
            m.Record(name, m.AAAA, 1, 300, bytes(15) + b"\x01"),
            m.Record(name, m.HTTPS, 1, 60, https_rdata()),
        ),
        (m.Record(name[1:], m.NS, 1, 60, m.encode_name(m.name_from_text("ns.example.test"))),),
        (m.Record((), m.OPT, 1232, 0x8000, b"\x00\x0a\x00\x08abcdefgh"),),
    )
    wire = m.build_message(msg)
    assert m.parse_message(wire) == msg
    # The answers' owner names are pointers to the question's name.
    assert wire.count(b"\x03www") == 1
    assert m.parse_message(wire).opt() == msg.additionals[0]


def test_compressed_rdata_names_are_expanded() -> None:
    # A CNAME whose target points back at the question's name: after parsing, its rdata holds the
    # whole name, so it stays valid wherever the message is built again.
    header = struct.pack("!6H", 7, m.QR, 1, 1, 0, 0)
    question = b"\x01a\x04test\x00" + struct.pack("!HH", m.A, 1)
    rdata = b"\x01b\xc0\x0e"  # "b" then a pointer to "test." at offset 14
    answer = b"\xc0\x0c" + struct.pack("!HHIH", m.CNAME, 1, 30, len(rdata)) + rdata
    msg = m.parse_message(header + question + answer)
    assert msg.answers[0].rdata == m.encode_name((b"b", b"test"))
    assert m.rdata_text(m.CNAME, msg.answers[0].rdata) == "b.test."
    assert m.parse_message(m.build_message(msg)) == msg


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"\x00" * 11,
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # pointer to itself
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\xc0\x20\x00\x01\x00\x01",  # pointer forwards
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\x40abc\x00\x00\x01\x00\x01",  # reserved label
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\x05ab",  # label cut short
        struct.pack("!6H", 1, 0, 0, 1, 0, 0) + b"\x00" + struct.pack("!HHIH", 1, 1, 1, 200),
        struct.pack("!6H", 1, 0, 1, 0, 0, 0)
        + b"\x3f"
        + b"a" * 63
        + b"\x3f"
        + b"a" * 63
        + b"\x3f"
        + b"a" * 63
        + b"\x3f"
        + b"a" * 63
        + b"\x00\x00\x01\x00\x01",  # name of 257 bytes
    ],
)
def test_malformed_messages_raise_the_format_error(wire: bytes) -> None:
    with pytest.raises(m.DnsFormatError):
        m.parse_message(wire)


def test_ech_is_taken_out_and_the_rest_kept() -> None:
    name = m.name_from_text("svc.example.test")
    record = m.Record(name, m.HTTPS, 1, 60, https_rdata())
    (cleaned,), changed = m.without_ech([record])
    assert changed == 1
    svcb = m.parse_svcb(cleaned.rdata)
    assert [k for k, _ in svcb.params] == [1, 4, 6]
    assert cleaned.rdata == https_rdata(ech=None)
    untouched, changed = m.without_ech([m.Record(name, m.HTTPS, 1, 60, https_rdata(None))])
    assert changed == 0
    assert untouched[0].rdata == https_rdata(None)
    # A malformed HTTPS record is not passed on: a lenient client might find ech in it.
    assert m.without_ech([m.Record(name, m.HTTPS, 1, 60, b"\x00\x01\x00\x00\x05\x00\x10")]) == (
        (),
        1,
    )


def test_ttl_offsets_point_at_every_ttl_but_opt() -> None:
    name = m.name_from_text("x.test")
    msg = m.Message(
        1,
        m.QR,
        (m.Question(name, m.A),),
        (m.Record(name, m.A, 1, 100, bytes(4)), m.Record(name, m.A, 1, 7, bytes(4))),
        (),
        (m.Record((), m.OPT, 1232, 0, b""),),
    )
    wire = m.build_message(msg)
    offsets = m.ttl_offsets(wire)
    assert [ttl for _, ttl in offsets] == [100, 7]
    assert all(struct.unpack_from("!I", wire, o)[0] == t for o, t in offsets)


labels = st.binary(min_size=1, max_size=20)
names = st.lists(labels, max_size=4).map(tuple)
records = st.builds(
    m.Record,
    names,
    st.sampled_from([m.A, m.AAAA, m.CNAME, m.MX, m.SOA, m.HTTPS, 16, 999]),
    st.integers(0, 0xFFFF),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=40),
)


def _valid_rdata(record: m.Record) -> m.Record:
    # Types whose rdata holds names must hold well-formed ones to round-trip.
    if record.rtype == m.CNAME:
        return m.Record(record.name, m.CNAME, record.rclass, record.ttl, m.encode_name(record.name))
    if record.rtype == m.MX:
        return m.Record(
            record.name, m.MX, record.rclass, record.ttl, b"\x00\x0a" + m.encode_name(record.name)
        )
    if record.rtype == m.SOA:
        rdata = m.encode_name(record.name) * 2 + bytes(20)
        return m.Record(record.name, m.SOA, record.rclass, record.ttl, rdata)
    return record


@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF),
    st.lists(
        st.builds(m.Question, names, st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)), max_size=2
    ),
    st.lists(records.map(_valid_rdata), max_size=5),
    st.lists(records.map(_valid_rdata), max_size=3),
)
def test_built_messages_parse_back(
    ident: int, flags: int, qs: list[m.Question], ans: list[m.Record], add: list[m.Record]
) -> None:
    msg = m.Message(ident, flags, tuple(qs), tuple(ans), (), tuple(add))
    assert m.parse_message(m.build_message(msg)) == msg


@settings(max_examples=2000)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_raise_the_format_error(data: bytes) -> None:
    try:
        msg = m.parse_message(data)
    except m.DnsFormatError:
        return
    # What parses can be built again and means the same.
    assert m.parse_message(m.build_message(msg)) == msg
    m.ttl_offsets(data)
    for record in msg.answers:
        m.rdata_text(record.rtype, record.rdata)
    m.without_ech(msg.answers)


@settings(max_examples=1000)
@given(st.binary(min_size=12, max_size=12), st.binary(max_size=300))
def test_header_plus_bytes_never_raise_anything_else(header: bytes, body: bytes) -> None:
    # A header that claims records makes the parser walk the body: every path ends in a value or
    # the one error.
    data = header[:4] + b"\x00\x02\x00\x03\x00\x01\x00\x02" + body
    try:
        m.parse_message(data)
    except m.DnsFormatError:
        pass
    try:
        m.ttl_offsets(data)
    except m.DnsFormatError:
        pass


def test_compression_keeps_the_case_of_each_name() -> None:
    msg = m.Message(
        1,
        m.QR,
        (m.Question((b"WwW", b"Test"), m.A),),
        (m.Record((b"www", b"test"), m.A, 1, 5, bytes(4)),),
    )
    assert m.parse_message(m.build_message(msg)) == msg
