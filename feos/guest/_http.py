"""A small blocking HTTP/1.1 client for registries spoken to over plain HTTP.

Why not http.client: under TCG its import (email's parser and ssl with it) costs the guest about
a quarter of a second of its one vCPU, on the path of every pod's first pull. A registry's GETs
need little: a request with `Connection: close`, a status line, headers, and a body framed by
chunks, by Content-Length or by the end of the connection. HTTPS stays on http.client (ssl is
needed then anyway).

The parsers are pure and take the registry's bytes as outside input: every malformed answer is a
ProtocolError (a ConnectionError, which the registry client turns into UNAVAILABLE), with the
limits http.client keeps (a line of 64 KiB, 100 headers).
"""

from __future__ import annotations

import socket
from io import BufferedReader

MAX_LINE = 65536
MAX_HEADERS = 100
NO_BODY = (204, 304)


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.x as this client reads it, or it was cut short."""


def split_host(host: str, default_port: int = 80) -> tuple[str, int]:
    """`name`, `name:port`, `[v6]` or `[v6]:port` as (name, port)."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            raise ProtocolError(f"{host!r}: an IPv6 address without its ]")
        name, rest = host[1:end], host[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ProtocolError(f"{host!r}: not [address]:port")
        port = rest[1:]
    else:
        name, _, port = host.partition(":")
    if not port:
        return name, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"{host!r}: the port is not 1 to 65535")
    return name, int(port)


def parse_status(line: bytes) -> tuple[int, str]:
    """b'HTTP/1.1 200 OK\\r\\n' as (200, 'OK')."""
    text = line.decode("latin-1").rstrip("\r\n")
    version, _, rest = text.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {text[:80]!r}")
    return int(code), reason.strip()


def parse_header(line: bytes) -> tuple[str, str]:
    """b'Name: value\\r\\n' as ('name', 'value')."""
    text = line.decode("latin-1").rstrip("\r\n")
    name, colon, value = text.partition(":")
    if not colon or not name or name != name.strip() or any(c in name for c in " \t"):
        raise ProtocolError(f"not a header line: {text[:80]!r}")
    return name.lower(), value.strip()


def chunk_size(line: bytes) -> int:
    """A chunk's size line (hex digits, then any ;extensions)."""
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > 16 or not all(c in b"0123456789abcdefABCDEF" for c in digits):
        raise ProtocolError(f"not a chunk size: {line[:40]!r}")
    return int(digits, 16)


def _line(f: BufferedReader) -> bytes:
    line = f.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise ProtocolError("a line over 64 KiB")
    if not line.endswith(b"\n"):
        raise ProtocolError("the connection ended inside the answer's head")
    return line


def read_head(f: BufferedReader) -> tuple[int, str, dict[str, str]]:
    """The status and headers of the answer (1xx answers passed over); a repeated header's
    values joined with ', ' as RFC 9110 allows."""
    while True:
        status, reason = parse_status(_line(f))
        headers: dict[str, str] = {}
        while (line := _line(f)) not in (b"\r\n", b"\n"):
            if len(headers) >= MAX_HEADERS:
                raise ProtocolError(f"over {MAX_HEADERS} headers")
            name, value = parse_header(line)
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if not 100 <= status < 200:
            return status, reason, headers


class Response:
    """An answer's status, headers and body, read as http.client.HTTPResponse reads it."""

    def __init__(
        self, f: BufferedReader, status: int, reason: str, headers: dict[str, str]
    ) -> None:
        self._f = f
        self.status, self.reason, self.headers = status, reason, headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._left: int | None = None  # bytes left of the body (or of the chunk), None: to EOF
        self._done = status in NO_BODY
        if not self._chunked and "content-length" in headers:
            length = headers["content-length"].split(",")[0].strip()
            if not length.isdigit():
                raise ProtocolError(f"Content-Length {headers['content-length'][:40]!r}")
            self._left = int(length)
            self._done = self._done or self._left == 0
        elif self._chunked:
            self._left = 0

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def read(self, amount: int = -1) -> bytes:
        """Up to amount bytes of the body (all of it with -1); b'' once it ended."""
        parts, want = [], amount if amount >= 0 else 1 << 62
        while want > 0 and not self._done:
            part = self._read_some(want)
            parts.append(part)
            want -= len(part)
        return b"".join(parts)

    def _read_some(self, want: int) -> bytes:
        if self._chunked and self._left == 0:
            size = chunk_size(_line(self._f))
            if size == 0:
                while _line(self._f) not in (b"\r\n", b"\n"):
                    pass  # the trailers
                self._done = True
                return b""
            self._left = size
        if self._left is None:
            data = self._f.read1(min(want, 1 << 20))
            self._done = not data
            return data
        data = self._f.read(min(want, self._left))
        if len(data) < min(want, self._left):
            raise ProtocolError("the connection ended inside the body")
        self._left -= len(data)
        if self._chunked and self._left == 0 and _line(self._f) not in (b"\r\n", b"\n"):
            raise ProtocolError("a chunk without its CRLF")
        self._done = not self._chunked and self._left == 0
        return data


class Connection:
    """One GET at a time over a connection of its own (the server closes it after the answer)."""

    def __init__(self, host: str, timeout: float) -> None:
        self.host = host
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._f: BufferedReader | None = None

    def request(self, method: str, path: str, headers: dict[str, str]) -> None:
        name, port = split_host(self.host)
        self._sock = socket.create_connection((name, port), timeout=self.timeout)
        self._f = self._sock.makefile("rb")
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self._sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))

    def getresponse(self) -> Response:
        if self._f is None:
            raise ProtocolError("no request was sent")
        return Response(self._f, *read_head(self._f))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._sock is not None:
            self._sock.close()
        self._f = self._sock = None
