"""HTTP/1.1 for the node's metadata server, sans-IO over h11: bytes in, requests out, answers
to bytes. The pods are untrusted: h11 parses what they send, this module only says what the
metadata service takes of it.

Theory of operation. One `HttpSession` per connection. `receive(data)` feeds what the socket
read (b"" at its end); `next_request()` gives NEED_MORE (read more), CLOSED (the peer is done,
or left mid-request: nothing to answer), a `BadRequest` (answer it and close) or a `Request`
with its whole body. `respond(response)` gives the bytes of the answer and starts the next
request when the connection goes on; `closing` says it does not (HTTP/1.0 without keep-alive,
Connection: close, an error). Requests a client pipelines wait in h11's buffer and come one
after the other, each after the answer before it.

What the service refuses beyond h11's own 400s: a head over 16 KiB (431), a body over 64 KiB
(413), a transfer coding (501: the guest's clients send none), an HTTP version other than 1.0
and 1.1 (505).
"""

from __future__ import annotations

import re

import attrs
import h11

from ._mmds import BadRequest, Request, Response

MAX_HEAD = 16 * 1024
MAX_BODY = 64 * 1024
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 413: "Payload Too Large", 431: "Request Header Fields Too "
           "Large", 501: "Not Implemented", 505: "HTTP Version Not Supported"}  # fmt: skip


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
NEED_MORE = _Marker("NEED_MORE")  # the request goes on past the bytes read so far
CLOSED = _Marker("CLOSED")  # the peer closed: nothing more comes, nothing to answer
Next = Request | BadRequest | _Marker


class HttpSession:
    """One connection's HTTP/1.1 exchanges (see the module's docstring)."""

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._request: Request | None = None  # its head, while its body comes
        self._body = bytearray()
        self._method = b""  # of the request being answered (a HEAD's answer has no body)
        self._eof = False

    def receive(self, data: bytes) -> None:
        self._eof = self._eof or not data
        self._h11.receive_data(data)

    def next_request(self) -> Next:
        try:
            return self._next()
        except h11.RemoteProtocolError as e:
            if self._eof:
                return CLOSED  # cut off mid-request: nobody reads an answer
            return BadRequest(e.error_status_hint, str(e) or "malformed request")

    def _next(self) -> Next:
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                return NEED_MORE
            if isinstance(event, h11.Request):
                refused = self._head(event)
                if refused is not None:
                    return refused
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > MAX_BODY:  # (h11 holds it to the Content-Length)
                    return BadRequest(413, "request body too large")
            elif isinstance(event, h11.EndOfMessage):
                assert self._request is not None
                request, self._request = self._request, None
                return _with_body(request, bytes(self._body))
            else:  # ConnectionClosed, or PAUSED after a close was decided
                return CLOSED

    def _head(self, event: h11.Request) -> BadRequest | None:
        self._method = event.method
        if event.http_version not in (b"1.0", b"1.1"):
            return BadRequest(505, "HTTP version not supported")
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in headers)
        if size > MAX_HEAD:  # (h11 bounds only a head that comes in pieces)
            return BadRequest(431, "request head too large")
        if any(_CONTROL.search(v) for _, v in event.headers):  # h11 lets them through
            return BadRequest(400, "malformed header value")
        if any(k == "transfer-encoding" for k, _ in headers):
            return BadRequest(501, "transfer codings are not supported")
        length = next((v for k, v in headers if k == "content-length"), "0")
        if int(length) > MAX_BODY:  # (h11 checked it is digits, and one value)
            return BadRequest(413, "request body too large")
        self._request = Request(event.method.decode("ascii"), event.target.decode("ascii"),
                                "HTTP/" + event.http_version.decode("ascii"), headers)
        self._body = bytearray()
        return None

    def respond(self, response: Response) -> bytes:
        """The answer's bytes; after a BadRequest the connection closes."""
        closing = response.status >= 400 and self._h11.their_state is not h11.DONE
        body = response.body.encode()
        headers = [("Content-Type", response.content_type), ("Content-Length", str(len(body)))]
        if response.allow:
            headers.append(("Allow", response.allow))
        if closing or self._h11.their_state is h11.ERROR:
            headers.append(("Connection", "close"))
        reason = REASONS.get(response.status, "Unknown")
        events: list[h11.Response | h11.Data | h11.EndOfMessage] = [
            h11.Response(status_code=response.status, headers=headers, reason=reason)]
        if self._method != b"HEAD":
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        out = b"".join(self._h11.send(e) or b"" for e in events)
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
        self._method = b""
        return out

    @property
    def closing(self) -> bool:
        """The connection ends after the answer sent."""
        return self._h11.our_state is not h11.IDLE


def _with_body(request: Request, body: bytes) -> Request:
    return attrs.evolve(request, body=body)


def parse_request(buf: bytes) -> tuple[Request, int] | BadRequest | _Marker:
    """The first request in buf: (Request, bytes used), a BadRequest, or NEED_MORE."""
    session = HttpSession()
    if buf:
        session.receive(buf)
    got = session.next_request()
    if isinstance(got, Request):
        return got, len(buf) - len(session._h11.trailing_data[0])
    return NEED_MORE if got is CLOSED else got
