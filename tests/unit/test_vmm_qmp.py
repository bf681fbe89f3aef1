"""QMP's pure part: framing, replies, events, greeting, and what is not QMP."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.vmm._qmp import Event, Greeting, QmpParser, QmpProtocolError, Reply, decode, encode


def test_greeting_reply_error_event() -> None:
    parser = QmpParser()
    msgs = parser.feed(
        b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n'
        b'{"return": {}, "id": 1}\r\n'
        b'{"error": {"class": "GenericError", "desc": "no"}, "id": 2}\r\n'
        b'{"timestamp": {"seconds": 1}, "event": "SHUTDOWN", "data": {"guest": true}}\r\n'
    )
    assert msgs == [
        Greeting({"qemu": {"major": 7}}),
        Reply(1, True, {}),
        Reply(2, False, {"class": "GenericError", "desc": "no"}),
        Event("SHUTDOWN", {"guest": True}),
    ]


def test_split_across_reads() -> None:
    parser = QmpParser()
    line = b'{"return": {"status": "running"}, "id": 7}\n'
    assert parser.feed(line[:10]) == []
    assert parser.feed(line[10:]) == [Reply(7, True, {"status": "running"})]


def test_encode_carries_id_and_arguments() -> None:
    assert json.loads(encode("migrate", {"uri": "fd:snapshot"}, 3)) == {
        "execute": "migrate", "id": 3, "arguments": {"uri": "fd:snapshot"}}  # fmt: skip
    assert json.loads(encode("stop", None, 4)) == {"execute": "stop", "id": 4}
    assert encode("stop", None, 4).endswith(b"\n")


@pytest.mark.parametrize(
    "line", [b"[1]", b"not json", b'{"what": 1}', b'{"return": 1, "id": "x"}', b'{"error": 3}']
)
def test_not_qmp(line: bytes) -> None:
    with pytest.raises(QmpProtocolError):
        decode(line)


def test_a_line_too_long() -> None:
    with pytest.raises(QmpProtocolError):
        QmpParser().feed(b"x" * (2 << 20))


@given(st.binary(max_size=300))
def test_parser_takes_any_bytes(data: bytes) -> None:
    parser = QmpParser()
    try:
        for msg in parser.feed(data):
            assert isinstance(msg, Reply | Event | Greeting)
    except QmpProtocolError:
        pass


@given(st.dictionaries(st.text(max_size=5), st.integers(), max_size=4), st.integers(1, 1 << 40))
def test_replies_round_trip(value: dict[str, int], msg_id: int) -> None:
    line = json.dumps({"return": value, "id": msg_id}).encode()
    assert decode(line) == Reply(msg_id, True, value)
