"""Firecracker's API over its Unix socket: HTTP/1.1 through h11 (sans-IO).

The protocol part is pure (encode a request, parse a response from bytes fed in any pieces) and
tested without sockets; `FirecrackerApi` is the thin trio loop around it, one connection per
request, which Firecracker's server answers with Content-Length or 204. A response that h11
cannot parse, a chunked one, a head over 16 KiB or a body over 4 MiB is a ProtocolError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import h11
import trio

from feos.errors import Code, FeosError

MAX_HEAD = 16 * 1024
MAX_BODY = 4 * 1024 * 1024
_SUN_PATH_MAX = 107
_HEADERS = [("Host", "localhost"), ("Accept", "application/json")]


class ProtocolError(Exception):
    """The bytes are not an HTTP/1.1 response we can take."""


def encode_request(method: str, path: str, body: Any = None) -> bytes:
    """One request; `body` is sent as JSON when not None."""
    if not path.startswith("/") or any(c in path for c in " \r\n"):
        raise ValueError(f"bad request path {path!r}")
    payload = b""
    headers = list(_HEADERS)
    if body is not None:
        payload = json.dumps(body, separators=(",", ":")).encode()
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
    conn = h11.Connection(h11.CLIENT)
    events: list[h11.Request | h11.Data | h11.EndOfMessage] = [
        h11.Request(method=method, target=path, headers=headers)]
    if payload:
        events.append(h11.Data(data=payload))
    events.append(h11.EndOfMessage())
    return b"".join(conn.send(e) or b"" for e in events)


@attrs.frozen
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def fault(self) -> str:
        """Firecracker's fault_message, else the body, else the reason."""
        try:
            parsed = self.json()
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("fault_message"), str):
            return str(parsed["fault_message"])
        return self.body.decode(errors="replace").strip() or self.reason


class ResponseParser:
    """Feed bytes as they come; `feed` returns the response once it is whole. h11 frames it as
    the answer to a request of `method` (a HEAD's answer has no body)."""

    def __init__(self, method: str = "GET") -> None:
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self._h11.send(h11.Request(method=method, target="/", headers=_HEADERS))
        self._h11.send(h11.EndOfMessage())
        self._head: tuple[int, str, dict[str, str]] | None = None
        self._body = bytearray()

    def feed(self, data: bytes) -> Response | None:
        if not data:
            return None  # (b"" is h11's end of stream: that is eof())
        self._h11.receive_data(data)
        return self._events()

    def eof(self) -> Response:
        """The connection closed: a response without a length ends here."""
        self._h11.receive_data(b"")
        got = self._events()
        if got is None:  # (h11 says NEED_DATA no more once it knows of the close)
            raise ProtocolError("connection closed before a response")
        return got

    def _events(self) -> Response | None:
        try:
            while True:
                event = self._h11.next_event()
                if event is h11.NEED_DATA:
                    return None
                if isinstance(event, h11.Response):
                    self._head = _head(event)
                    if _unframed(event):  # Firecracker keeps the connection: no body comes
                        return Response(*self._head, b"")
                elif isinstance(event, h11.Data):
                    self._body += event.data
                    if len(self._body) > MAX_BODY:
                        raise ProtocolError("response body too long")
                elif isinstance(event, h11.EndOfMessage):
                    assert self._head is not None
                    return Response(*self._head, bytes(self._body))
                elif not isinstance(event, h11.InformationalResponse):
                    raise ProtocolError("connection closed before a response")
        except h11.RemoteProtocolError as e:
            if not self._h11.trailing_data[1]:
                raise ProtocolError(f"not an HTTP/1.1 response: {e}") from e
            where = "before a response" if self._head is None else "inside the body"
            raise ProtocolError(f"connection closed {where}") from e


def _unframed(event: h11.Response) -> bool:
    """A response with a body but neither a length nor a coding: HTTP reads it to the close,
    but Firecracker's server leaves the connection open, so it is taken as empty."""
    names = {k for k, _ in event.headers}
    no_body = event.status_code in (204, 304) or event.status_code < 200
    return not no_body and not names & {b"content-length", b"transfer-encoding"}


def _head(event: h11.Response) -> tuple[int, str, dict[str, str]]:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
    if "transfer-encoding" in headers:
        raise ProtocolError("chunked responses are not taken")
    if int(headers.get("content-length", "0")) > MAX_BODY:  # (h11 checked it is digits)
        raise ProtocolError(f"bad content-length {headers['content-length']!r}")
    return event.status_code, event.reason.decode("latin-1"), headers


def check(response: Response, what: str) -> Response:
    """A 2xx response, or a FeosError naming the call and Firecracker's fault."""
    if 200 <= response.status < 300:
        return response
    code = Code.FAILED_PRECONDITION if response.status == 400 else Code.INTERNAL
    raise FeosError(code, f"Firecracker {what}: {response.status} {response.fault}")


# -- the I/O -----------------------------------------------------------------------------------


async def _connect(path: Path) -> trio.SocketStream:
    """Connect to a Unix socket; a path longer than sun_path goes through /proc/self/fd."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return await trio.open_unix_socket(str(path))
    dirfd = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    try:
        return await trio.open_unix_socket(f"/proc/self/fd/{dirfd}/{path.name}")
    finally:
        os.close(dirfd)


@attrs.define
class FirecrackerApi:
    """Firecracker's API socket (fc.sock in the jail)."""

    socket: Path
    timeout: float = 10.0

    async def request(self, method: str, path: str, body: Any = None, *,
                      within: float | None = None) -> Response:
        what = f"{method} {path}"
        limit = self.timeout if within is None else within
        try:
            with trio.fail_after(limit):
                return await self._exchange(method, encode_request(method, path, body))
        except trio.TooSlowError:
            raise FeosError(Code.UNAVAILABLE,
                            f"Firecracker {what}: no answer within {limit:g}s") from None
        except (OSError, trio.BrokenResourceError) as e:
            raise FeosError(Code.UNAVAILABLE, f"Firecracker {what}: {e}") from e
        except ProtocolError as e:
            raise FeosError(Code.INTERNAL, f"Firecracker {what}: {e}") from e

    async def _exchange(self, method: str, raw: bytes) -> Response:
        stream = await _connect(self.socket)
        async with stream:
            await stream.send_all(raw)
            parser = ResponseParser(method)
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return parser.eof()
                done = parser.feed(data)
                if done is not None:
                    return done

    async def call(self, method: str, path: str, body: Any = None, *,
                   within: float | None = None) -> Response:
        answer = await self.request(method, path, body, within=within)
        return check(answer, f"{method} {path}")

    async def describe(self) -> dict[str, Any]:
        """GET /: the instance's id, state ("Not started", "Running", "Paused") and version."""
        got = (await self.call("GET", "/")).json()
        if not isinstance(got, dict):
            raise FeosError(Code.INTERNAL, "Firecracker GET /: not an object")
        return got

    async def put(self, path: str, body: Any) -> None:
        await self.call("PUT", path, body)

    async def action(self, action_type: str) -> None:
        """InstanceStart, SendCtrlAltDel or FlushMetrics."""
        await self.call("PUT", "/actions", {"action_type": action_type})

    async def pause(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Paused"})

    async def resume(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Resumed"})

    async def snapshot_create(self, vmstate: str, memory: str, *, within: float) -> None:
        """A full snapshot; paths are inside the jail. Past `within` seconds this raises UNAVAILABLE
        while Firecracker writes on: the caller marks the snapshot late."""
        body = {"snapshot_type": "Full", "snapshot_path": vmstate, "mem_file_path": memory}
        await self.call("PUT", "/snapshot/create", body, within=within)

    async def snapshot_load(self, vmstate: str, memory: str, backend: str = "File") -> None:
        """Load with the vCPUs stopped: the caller puts the MMDS back before it resumes.
        backend "File": memory is the memory file; "Uffd": the socket of a page fault handler
        that serves the memory (diskd's, docs/disk.md "Serving memory lazily")."""
        await self.call("PUT", "/snapshot/load", {
            "snapshot_path": vmstate,
            "mem_backend": {"backend_type": backend, "backend_path": memory},
            "resume_vm": False,
        })

    async def put_mmds(self, data: Any) -> None:
        await self.call("PUT", "/mmds", data)

    async def balloon_statistics(self) -> dict[str, Any]:
        got = (await self.call("GET", "/balloon/statistics")).json()
        return got if isinstance(got, dict) else {}
