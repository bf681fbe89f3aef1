"""The guest's plain-HTTP client (feos.guest._http): its parsers on any bytes, and its bodies
(chunked, by Content-Length, to the end) read back whole from a real socket's answers."""

from __future__ import annotations

import io
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.guest import _http
from feos.guest._http import ProtocolError


def _head(raw: bytes) -> tuple[int, str, dict[str, str]]:
    return _http.read_head(io.BufferedReader(io.BytesIO(raw)))  # type: ignore[arg-type]


def answer(raw: bytes) -> _http.Response:
    """The answer `raw`, as a server that writes it and closes would give it."""
    f = io.BufferedReader(io.BytesIO(raw))  # type: ignore[arg-type]
    return _http.Response(f, *_http.read_head(f))  # type: ignore[arg-type]


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for size in sizes:
        part = body[i : i + size]
        if not part:
            break
        out += b"%x;ext=1\r\n" % len(part) + part + b"\r\n"
        i += len(part)
    rest = body[i:]
    if rest:
        out += b"%X\r\n" % len(rest) + rest + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


@given(st.binary(max_size=5000), st.lists(st.integers(1, 700), max_size=12),
       st.integers(1, 2000))
def test_a_chunked_body_reads_back_whole(body: bytes, sizes: list[int], step: int) -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes)
    resp = answer(raw)
    got = b""
    while part := resp.read(step):
        got += part
    assert got == body
    assert resp.read() == b""


@given(st.binary(max_size=5000), st.integers(1, 2000), st.booleans())
def test_a_body_by_length_or_to_the_end(body: bytes, step: int, by_length: bool) -> None:
    head = b"HTTP/1.0 200 OK\r\nContent-Type: x\r\n"
    head += b"Content-Length: %d\r\n" % len(body) if by_length else b""
    resp = answer(head + b"\r\n" + body + (b"extra after the body" if by_length else b""))
    got = b""
    while part := resp.read(step):
        got += part
    assert got == body


def test_a_body_cut_short_is_a_protocol_error() -> None:
    resp = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(ProtocolError, match="inside the body"):
        resp.read()
    resp = answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc")
    with pytest.raises(ProtocolError):
        resp.read()


def test_head_continue_headers_joined_and_no_body() -> None:
    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 401 Unauthorized\r\n"
           b"WWW-Authenticate: Bearer realm=\"r\"\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
    status, reason, headers = _head(raw)
    assert (status, reason, headers["x-a"]) == (401, "Unauthorized", "1, 2")
    resp = answer(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nnever")
    assert resp.read() == b"" and resp.getheader("Content-Length") == "5"


@given(st.binary(max_size=300))
def test_any_head_parses_or_is_a_protocol_error(raw: bytes) -> None:
    try:
        status, _, headers = _head(raw)
    except ProtocolError:
        return
    assert 200 <= status <= 999 or status < 100
    assert all(k == k.lower() for k in headers)


@given(st.binary(max_size=40))
def test_any_chunk_size_line_parses_or_is_refused(line: bytes) -> None:
    try:
        size = _http.chunk_size(line)
    except ProtocolError:
        return
    assert 0 <= size < 1 << 64


@given(st.text(max_size=40))
def test_any_host_splits_or_is_refused(host: str) -> None:
    try:
        name, port = _http.split_host(host)
    except ProtocolError:
        return
    assert 0 < port < 65536 and name in host


def test_hosts() -> None:
    assert _http.split_host("198.51.100.1:5000") == ("198.51.100.1", 5000)
    assert _http.split_host("[fd00::1]:5000") == ("fd00::1", 5000)
    assert _http.split_host("[fd00::1]") == ("fd00::1", 80)
    assert _http.split_host("localhost") == ("localhost", 80)
    with pytest.raises(ProtocolError):
        _http.split_host("host:99999")


def test_a_get_over_a_socket_sends_its_head_and_reads_the_answer() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            seen.append(data)
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + chunked(b"x" * 3000, [1000, 7]))

    thread = threading.Thread(target=serve)
    thread.start()
    conn = _http.Connection(f"127.0.0.1:{port}", timeout=10)
    try:
        conn.request("GET", "/v2/a/manifests/1", {"Accept": "*/*", "Authorization": "Bearer t"})
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, b"x" * 3000)
    finally:
        conn.close()
        thread.join()
        server.close()
    head = seen[0].decode()
    assert head.startswith("GET /v2/a/manifests/1 HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{port}\r\n" in head and "Connection: close\r\n" in head
    assert "Authorization: Bearer t\r\n" in head
