"""The metadata server's HTTP/1.1 (feos.net._mmds_http over h11) on what a pod may send.

Malformed requests (a bad request line, headers over 16 KiB, a body over 64 KiB, a transfer
coding, HTTP/2.0, an HTTP/1.1 request without Host) are answered with their status and the
connection closed; pipelined requests are answered in order; a request split byte by byte reads
as the whole; the server's connection loop ends normally after each, and random bytes in random
pieces never raise. The answers are read back with h11's client.
"""

from __future__ import annotations

import itertools
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.net._metadata_server import MetadataServer
from feos.net._mmds import MmdsStore, Request, bad_request_response, metadata_object
from feos.net._mmds_http import CLOSED, NEED_MORE, HttpSession

DATA = metadata_object("p1", "2001:db8::5", "169.254.16.5", {"role": "web"})
TOKEN_PUT = (b"PUT /latest/api/token HTTP/1.1\r\nHost: m\r\n"
             b"X-metadata-token-ttl-seconds: 60\r\n\r\n")  # fmt: skip


def _store() -> MmdsStore:
    counter = itertools.count()
    return MmdsStore(DATA, lambda n: bytes([next(counter) % 256]) * n)


def _answers(raw: bytes, method: bytes = b"GET") -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The responses in raw, read by h11's client (status, headers, body)."""
    client = h11.Connection(h11.CLIENT)
    out = []
    client.receive_data(raw)
    client.receive_data(b"")
    while True:
        client.send(h11.Request(method=method, target="/", headers=[("Host", "m")]))
        client.send(h11.EndOfMessage())
        head, body = None, b""
        while True:
            try:
                event = client.next_event()
            except h11.RemoteProtocolError:  # closed where the next response would start
                assert head is None and not body
                return out
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                return out
        assert head is not None
        out.append((head.status_code, dict(head.headers), body))
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            return out
        client.start_next_cycle()


async def _serve(*chunks: bytes) -> bytes:
    """What the server's connection loop answers to chunks sent in order, then EOF; the loop
    must end by itself."""
    ours, theirs = trio.testing.memory_stream_pair()
    server = MetadataServer(clock=lambda: 0.0)
    got = bytearray()

    async def client() -> None:
        for chunk in chunks:
            await ours.send_all(chunk)
        await ours.send_eof()
        while data := await ours.receive_some(65536):
            got.extend(data)

    with trio.fail_after(10):  # a loop that hangs fails here (not a timing assertion)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await server._requests(_store(), theirs)  # type: ignore[arg-type]
            await theirs.aclose()
    return bytes(got)


MALFORMED = [
    (b"GET /\r\n\r\n", 400),  # no version (HTTP/0.9)
    (b"GET  / HTTP/1.1\r\nHost: m\r\n\r\n", 400),  # two spaces
    (b"G\x00T / HTTP/1.1\r\nHost: m\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: m\r\nNo colon\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: m\r\nX: a\x01b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
    (b"GET / HTTP/1.1\r\nHost: m\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: m\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: m\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 20000, 431),  # a request line that never ends
    (b"PUT / HTTP/1.1\r\nHost: m\r\nContent-Length: 70000\r\n\r\n", 413),
    (b"PUT / HTTP/1.1\r\nHost: m\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
    (b"GET / HTTP/2.0\r\nHost: m\r\n\r\n", 505),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "status"), MALFORMED)
async def test_malformed_requests_are_answered_and_closed(raw: bytes, status: int) -> None:
    answers = _answers(await _serve(raw))
    assert [a[0] for a in answers] == [status]
    assert answers[0][1][b"connection"] == b"close"


@pytest.mark.parametrize(("raw", "status"), MALFORMED)
async def test_a_malformed_request_after_a_good_one(raw: bytes, status: int) -> None:
    answers = _answers(await _serve(TOKEN_PUT + raw))
    assert [a[0] for a in answers] == [200, status]


async def test_pipelined_requests_are_answered_in_order() -> None:
    token = _answers(await _serve(TOKEN_PUT))[0][2]
    get = b"GET /feos/ipv4 HTTP/1.1\r\nHost: m\r\nX-metadata-token: " + token + b"\r\n\r\n"
    raw = TOKEN_PUT + get + b"GET /nothing HTTP/1.1\r\nHost: m\r\n\r\n" + get
    answers = _answers(await _serve(raw))
    assert [(s, b if s == 200 and b != token else None) for s, _, b in answers] == [
        (200, None), (200, b"169.254.16.5"), (401, None), (200, b"169.254.16.5")]


async def test_a_request_split_byte_by_byte_reads_as_the_whole() -> None:
    raw = TOKEN_PUT + b"GET /x HTTP/1.1\r\nHost: m\r\nContent-Length: 3\r\n\r\nabc"
    whole = await _serve(raw)
    assert await _serve(*(raw[i : i + 1] for i in range(len(raw)))) == whole
    assert [a[0] for a in _answers(whole)] == [200, 401]


async def test_http_1_0_and_connection_close_end_the_connection() -> None:
    for raw in (b"GET / HTTP/1.0\r\n\r\n", b"GET / HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n"):
        answers = _answers(await _serve(raw + TOKEN_PUT))
        assert [a[0] for a in answers] == [401]  # the PUT after it is not read


async def test_a_head_is_answered_without_a_body() -> None:
    got = await _serve(b"HEAD / HTTP/1.1\r\nHost: m\r\n\r\n")
    ((status, headers, body),) = _answers(got, method=b"HEAD")
    assert (status, headers[b"allow"], body) == (405, b"GET, PUT", b"")


async def test_a_guest_that_leaves_mid_request_gets_no_answer() -> None:
    assert await _serve(b"PUT /latest/api/token HTTP/1.1\r\nHost: m\r\nContent-Le") == b""
    assert await _serve(b"PUT / HTTP/1.1\r\nHost: m\r\nContent-Length: 9\r\n\r\nabc") == b""


@given(st.binary(max_size=400), st.lists(st.integers(1, 64), max_size=20))
@settings(max_examples=400, deadline=None)
def test_any_bytes_in_any_pieces_never_raise(data: bytes, cuts: list[int]) -> None:
    session, at, store = HttpSession(), 0, _store()
    for n in [*cuts, len(data)]:
        session.receive(data[at : at + n] or b"")
        at += n
        while True:
            got: Any = session.next_request()
            if got is NEED_MORE or got is CLOSED:
                break
            answer = store.respond(got, 0.0) if isinstance(got, Request) else \
                bad_request_response(got)  # fmt: skip
            assert session.respond(answer).startswith(b"HTTP/1.1 ")
            if session.closing:
                return
        if at >= len(data):
            return

