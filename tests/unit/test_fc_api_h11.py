"""Firecracker's API client over h11 (feos.vmm._firecracker_api): responses as Firecracker's
micro_http writes them (an empty reason, HTTP/1.0 or 1.1, keep-alive), framing h11 does for us
(a HEAD's answer, 100 Continue), and the refusals and cut connections it names."""

from __future__ import annotations

import pytest

from feos.vmm._firecracker_api import ProtocolError, ResponseParser, encode_request

MICRO_HTTP = (b"HTTP/1.0 200 \r\nServer: Firecracker API\r\nConnection: keep-alive\r\n"
              b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip


def test_micro_http_s_response_reads() -> None:
    got = ResponseParser().feed(MICRO_HTTP)
    assert got is not None
    assert (got.status, got.reason, got.json()) == (200, "", {})


def test_a_response_without_a_length_is_taken_as_empty() -> None:
    # Firecracker's server keeps the connection open: reading to its close would hang.
    got = ResponseParser().feed(b"HTTP/1.1 200 OK\r\nServer: Firecracker API\r\n\r\n")
    assert got is not None and got.body == b""


def test_a_head_s_answer_has_no_body_and_100_continue_is_skipped() -> None:
    got = ResponseParser("HEAD").feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
    assert got is not None and got.body == b""
    got = ResponseParser("PUT").feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 \r\n\r\n")
    assert got is not None and got.status == 204


@pytest.mark.parametrize(("raw", "why"), [
    (b"", "closed before a response"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "closed before a response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", "closed inside the body"),
])  # fmt: skip
def test_a_cut_connection_is_named(raw: bytes, why: str) -> None:
    parser = ResponseParser()
    assert parser.feed(raw) is None
    with pytest.raises(ProtocolError, match=why):
        parser.eof()


@pytest.mark.parametrize(("raw", "why"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "content-length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "not an HTTP"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 20000, "not an HTTP"),
])  # fmt: skip
def test_bad_responses_are_protocol_errors(raw: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        ResponseParser().feed(raw)


def test_requests_carry_their_body_s_length() -> None:
    raw = encode_request("PATCH", "/vm", {"state": "Paused"})
    assert raw.startswith(b"PATCH /vm HTTP/1.1\r\nHost: localhost\r\n")
    assert b"Content-Length: 18\r\n\r\n{\"state\":\"Paused\"}" in raw
