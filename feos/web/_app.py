"""The console's ASGI application: its page, its static files, the API's calls, its streams.

Routes (everything else is 404):
    GET  /                      the page, with the CSRF token in a meta tag
    GET  /static/NAME           the page's CSS and JavaScript (package data)
    GET  /login?token=T         sets the access-token cookie (a console bound off loopback)
    POST /api/SERVICE/METHOD    a call of the API's table (feos.web._api.CALLS), JSON in and out
    GET  /events                the pods' events, server-sent (one `data:` per event)
    GET  /stream/logs?id=&container=&follow=1, /stream/console?id=&follow=1
                                a ByteStream server-sent as {"stdout", "stderr"} text chunks
Every request passes the Guard first (feos.web._security). A call's failure answers HTTP 200
with the API's status ({"status": {"code", "message"}}), as the API itself does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import trio

from ..errors import Code, FeosError
from ._api import CALLS, Api, error_answer
from ._security import COOKIE, Guard

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

STATIC = {"app.js": "text/javascript", "style.css": "text/css"}
MAX_BODY = 1 << 20
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


def _asset(name: str) -> bytes:
    return resources.files("feos.web").joinpath("static", name).read_bytes()


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _query(scope: Scope) -> dict[str, str]:
    raw = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {k: v[-1] for k, v in raw.items()}


async def _respond(send: Send, status: int, body: bytes, kind: str,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", kind.encode()), *SECURITY_HEADERS, *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, value: Any, status: int = 200) -> None:
    await _respond(send, status, json.dumps(value, default=_plain).encode(), "application/json")


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON")


async def _body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if len(body) > MAX_BODY:
            raise FeosError(Code.INVALID_ARGUMENT, "the request is larger than 1 MiB")
        if not message.get("more_body"):
            return bytes(body)


class ConsoleApp:
    """The ASGI app of one console: `api` reaches the services, `guard` says who may."""

    def __init__(self, api: Api, guard: Guard) -> None:
        self.api = api
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        refusal = self.guard.refusal(method, _headers(scope))
        if refusal is not None and not (path == "/login" and method == "GET"):
            origin = _headers(scope).get("origin", "no origin")
            log.info("refused %s %s from %s: %s", method, path, origin, refusal[1])
            await _respond(send, refusal[0], refusal[1].encode(), "text/plain; charset=utf-8")
            return
        await self.route(method, path, scope, receive, send)

    async def route(self, method: str, path: str, scope: Scope, receive: Receive,
                    send: Send) -> None:
        if method == "GET" and path == "/":
            await self.page(send)
        elif method == "GET" and path.startswith("/static/") and path[8:] in STATIC:
            await _respond(send, 200, _asset(path[8:]), STATIC[path[8:]] + "; charset=utf-8")
        elif method == "GET" and path == "/login":
            await self.login(_query(scope).get("token", ""), send)
        elif method == "POST" and path.startswith("/api/"):
            await self.call(path[5:], receive, send)
        elif method == "GET" and path == "/events":
            await _until_disconnect(receive, self.events(send))
        elif method == "GET" and path.startswith("/stream/"):
            await _until_disconnect(receive, self.stream(path[8:], _query(scope), send))
        else:
            await _respond(send, 404, b"not found", "text/plain; charset=utf-8")

    async def page(self, send: Send) -> None:
        html = _asset("index.html").replace(b"{{csrf}}", self.guard.csrf.encode())
        await _respond(send, 200, html, "text/html; charset=utf-8")

    async def login(self, token: str, send: Send) -> None:
        if not self.guard.login(token):
            await _respond(send, 401, b"a wrong token", "text/plain; charset=utf-8")
            return
        cookie = f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/".encode()
        await _respond(send, 303, b"", "text/plain", [(b"set-cookie", cookie), (b"location", b"/")])

    async def call(self, name: str, receive: Receive, send: Send) -> None:
        service, _, method = name.partition("/")
        try:
            if (service, method) not in CALLS:
                raise FeosError(Code.NOT_FOUND, f"{name}: not a call of the console")
            params = json.loads(await _body(receive) or b"{}")
            if not isinstance(params, dict):
                raise FeosError(Code.INVALID_ARGUMENT, "the params must be a JSON object")
            answer = await self.api.call(service, method, params)
        except FeosError as exc:
            await _json(send, error_answer(exc))
        except ValueError as exc:
            await _json(send, error_answer(FeosError(Code.INVALID_ARGUMENT, f"not JSON: {exc}")))
        else:
            await _json(send, answer)

    async def events(self, send: Send) -> None:
        await _sse_start(send)
        async for batch in self.api.events():
            data = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in batch)
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"event: end\ndata: {}\n\n"})

    async def stream(self, name: str, query: dict[str, str], send: Send) -> None:
        if name not in ("logs", "console"):
            await _respond(send, 404, b"not found", "text/plain; charset=utf-8")
            return
        params: dict[str, Any] = {"id": query.get("id", ""), "follow": query.get("follow") == "1"}
        if name == "logs":
            params["container"] = query.get("container", "")
        await _sse_start(send)
        try:
            async for chunk in self.api.bytes(name, params):
                await _sse(send, {k: chunk.get(k, b"") for k in ("stdout", "stderr", "exited")})
        except FeosError as exc:
            await _sse(send, error_answer(exc))
        await send({"type": "http.response.body", "body": b"event: end\ndata: {}\n\n"})


async def _until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> None:
    """Run a stream's `work` until it ends or the browser goes away (its watcher let go then)."""
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        async def run() -> None:
            await work
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        nursery.start_soon(run)


async def _sse_start(send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream"), *SECURITY_HEADERS]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})


async def _sse(send: Send, value: Any) -> None:
    data = b"data: %s\n\n" % json.dumps(value, default=_plain).encode()
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
