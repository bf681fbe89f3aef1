"""Firecracker's API over its Unix socket: a small HTTP/1.1 client of our own.

The protocol part is pure (encode a request, parse a response from bytes fed in any pieces) and
tested without sockets; `FirecrackerApi` is the thin trio loop around it, one connection per
request, which Firecracker's server answers with Content-Length or 204 and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

MAX_HEAD = 16 * 1024
MAX_BODY = 4 * 1024 * 1024
_SUN_PATH_MAX = 107


class ProtocolError(Exception):
    """The bytes are not an HTTP/1.1 response we can take."""


def encode_request(method: str, path: str, body: Any = None) -> bytes:
    """One request; `body` is sent as JSON when not None."""
    if not path.startswith("/") or any(c in path for c in " \r\n"):
        raise ValueError(f"bad request path {path!r}")
    head = [f"{method} {path} HTTP/1.1", "Host: localhost", "Accept: application/json"]
    payload = b""
    if body is not None:
        payload = json.dumps(body, separators=(",", ":")).encode()
        head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


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
    """Feed bytes as they come; `feed` returns the response once it is whole."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[int, str, dict[str, str]] | None = None
        self._length = 0

    def feed(self, data: bytes) -> Response | None:
        self._buf += data
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise ProtocolError("response head too long")
                return None
            self._head = _parse_head(bytes(self._buf[:end]))
            self._length = _content_length(*self._head)
            del self._buf[: end + 4]
        if len(self._buf) < self._length:
            return None
        status, reason, headers = self._head
        return Response(status, reason, headers, bytes(self._buf[: self._length]))

    def eof(self) -> Response:
        """The connection closed: a response without a length ends here."""
        if self._head is None:
            raise ProtocolError("connection closed before a response")
        if len(self._buf) < self._length:
            raise ProtocolError("connection closed inside the body")
        status, reason, headers = self._head
        return Response(status, reason, headers, bytes(self._buf[: self._length]))


def _parse_head(raw: bytes) -> tuple[int, str, dict[str, str]]:
    try:
        lines = raw.decode("ascii").split("\r\n")
    except UnicodeDecodeError as e:
        raise ProtocolError("response head is not ASCII") from e
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or not (len(code) == 3 and code.isdigit()):
        raise ProtocolError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(f"bad header line {line!r}")
        headers[name.lower()] = value.strip()
    return int(code), reason, headers


def _content_length(status: int, reason: str, headers: dict[str, str]) -> int:
    if status in (204, 304) or 100 <= status < 200:
        return 0
    if "transfer-encoding" in headers:
        raise ProtocolError("chunked responses are not taken")
    raw = headers.get("content-length", "0")
    if not raw.isdigit() or int(raw) > MAX_BODY:
        raise ProtocolError(f"bad content-length {raw!r}")
    return int(raw)


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
                return await self._exchange(encode_request(method, path, body))
        except trio.TooSlowError:
            raise FeosError(Code.UNAVAILABLE,
                            f"Firecracker {what}: no answer within {limit:g}s") from None
        except (OSError, trio.BrokenResourceError) as e:
            raise FeosError(Code.UNAVAILABLE, f"Firecracker {what}: {e}") from e
        except ProtocolError as e:
            raise FeosError(Code.INTERNAL, f"Firecracker {what}: {e}") from e

    async def _exchange(self, raw: bytes) -> Response:
        stream = await _connect(self.socket)
        async with stream:
            await stream.send_all(raw)
            parser = ResponseParser()
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

    async def snapshot_load(self, vmstate: str, memory: str) -> None:
        """Load with the vCPUs stopped: the caller puts the MMDS back before it resumes."""
        await self.call("PUT", "/snapshot/load", {
            "snapshot_path": vmstate,
            "mem_backend": {"backend_type": "File", "backend_path": memory},
            "resume_vm": False,
        })

    async def put_mmds(self, data: Any) -> None:
        await self.call("PUT", "/mmds", data)

    async def balloon_statistics(self) -> dict[str, Any]:
        got = (await self.call("GET", "/balloon/statistics")).json()
        return got if isinstance(got, dict) else {}
