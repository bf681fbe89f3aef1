"""Firecracker's HTTP/1.1 client, its bytes alone: requests encoded, responses parsed in pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.vmm._firecracker_api import (
    ProtocolError,
    Response,
    ResponseParser,
    check,
    encode_request,
)


def test_put_with_json_body() -> None:
    raw = encode_request("PUT", "/actions", {"action_type": "InstanceStart"})
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "PUT /actions HTTP/1.1"
    assert "Content-Type: application/json" in lines
    assert f"Content-Length: {len(body)}" in lines
    assert json.loads(body) == {"action_type": "InstanceStart"}


def test_get_has_no_body() -> None:
    assert encode_request("GET", "/").endswith(b"\r\n\r\n")
    assert b"Content-Length" not in encode_request("GET", "/balloon/statistics")


def test_bad_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="bad request path"):
        encode_request("GET", "/a b")
    with pytest.raises(ValueError, match="bad request path"):
        encode_request("GET", "x")


def _response(status: int, reason: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} {reason}\r\nServer: Firecracker API\r\n"
    if status != 204:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


@given(st.sampled_from([200, 204, 400, 500]), st.binary(max_size=300),
       st.lists(st.integers(min_value=1, max_value=50), max_size=30))
def test_response_in_any_pieces(status: int, body: bytes, cuts: list[int]) -> None:
    body = b"" if status == 204 else body
    raw = _response(status, "Whatever", body)
    parser = ResponseParser()
    got, pos = None, 0
    for n in [*cuts, len(raw)]:
        if got is None and pos < len(raw):
            got = parser.feed(raw[pos : pos + n])
            pos += n
    assert got == Response(status, "Whatever",
                           {"server": "Firecracker API",
                            **({} if status == 204 else {"content-length": str(len(body))})},
                           body)


@given(st.binary(max_size=400))
def test_parser_takes_any_bytes(data: bytes) -> None:
    parser = ResponseParser()
    try:
        got = parser.feed(data)
        if got is None:
            parser.eof()
    except ProtocolError:
        pass


def test_chunked_is_refused() -> None:
    with pytest.raises(ProtocolError, match="chunked"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")


def test_eof_inside_body() -> None:
    parser = ResponseParser()
    assert parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc") is None
    with pytest.raises(ProtocolError, match="inside the body"):
        parser.eof()


def test_fault_message_becomes_the_error() -> None:
    body = b'{"fault_message":"The requested operation is not supported in the current state."}'
    bad = Response(400, "Bad Request", {}, body)
    with pytest.raises(FeosError) as e:
        check(bad, "PATCH /vm")
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "not supported in the current state" in e.value.message
    ok = Response(204, "No Content", {}, b"")
    assert check(ok, "PUT /actions") is ok
