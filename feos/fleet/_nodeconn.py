"""Node connections: the dialers, and the thin trio loop around the HTTP/2 core.

Theory of operation: `NodeConnections.run` runs on the link's own trio run (another thread than
feosd's). One dialer per target dials TCP (keepalive, TCP_USER_TIMEOUT 20 s), does TLS with the
context it was given last (ALPN feos-node/1, which the peer must select), hands the handshake to
`verify` (the SPIFFE check) before any HTTP/2 byte goes out, and serves the connection. A
connection that ends (the peer's EOF or GOAWAY, a protocol error, our ping unanswered) is dialed
again after 1 s, doubling to 30 s while dials fail.

A connection (`Connection`) is four kinds of task in one nursery over a `TLSSocket` (feos.fleet's
own TLS over the socket: trio.SSLStream's task hops and checkpoints cost more than a call's own
work). The reader feeds the core the peer's bytes, acts on its events, and sends what they made
in the same turn (one TLS write and one send for all the answers of one read: a plain read such
as GetVolume is answered without a task or a hop); the writer sends what the core has to say
when the rest gave it something (the calls' tasks, the pings: their writes batch up) and waits
for the socket when it does not take everything; the ticker runs the core's pings; each call
that runs elsewhere is a task in its own cancel scope, answered through the core. A stream the
peer resets cancels its call's scope, which drops the call's wait on feosd's runtime. While more
than MAX_PENDING bytes wait for the socket, the reader reads no more.

`shut(grace, message)` is the graceful end: the core's GOAWAY, the calls in flight given `grace`
seconds, those left cancelled and answered UNAVAILABLE `message` (as their answer, or as a
stream's trailers after what it sent), then the last GOAWAY and the close, within 5 s. The stop
shuts every connection; a new SSL context or a target that is no longer listed shuts the
connections they concern with a grace of 30 s, the first dialing anew at once.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ..errors import Code, FeosError
from ._calls import Answer, Dispatcher
from ._h2server import (
    EOF_REASON,
    CallStarted,
    ConnectionEnded,
    PingAnswered,
    StreamGone,
)
from ._nghttp2 import server_core
from ._tls import TLSSocket

log = logging.getLogger(__name__)

ALPN = "feos-node/1"
FIRST_REDIAL = 1.0
MAX_REDIAL = 30.0
HANDSHAKE_TIMEOUT = 10.0
CLOSE_WITHIN = 5.0
DRAIN_GRACE = 30.0  # a renewal's or a dropped target's connection: its calls' time to end
USER_TIMEOUT_MS = 20_000
STREAM_BUFFER = 256 * 1024
MAX_PENDING = 4 * 1024 * 1024  # bytes for the socket past which the reader waits for it
LINGER = 0.5  # a stream's bytes waiting for window before its next pull


@attrs.frozen
class Target:
    host: str
    port: int
    server_name: str


def stop_message(grace: float) -> str:
    return f"the node stops: the call did not end within {grace:g}s of feosd's stop"


class Connection:
    """One HTTP/2 connection, feosd the server, over `tls` (its handshake done)."""

    def __init__(self, tls: TLSSocket, dispatcher: Dispatcher, *,
                 max_streams: int = 1024, ping_interval: float = 10.0,
                 ping_timeout: float = 20.0) -> None:
        self.tls = tls
        self.dispatcher = dispatcher
        # libnghttp2's core, or h2's (FEOS_FLEET_HTTP2=h2): feos/fleet/_nghttp2.py
        self.core = server_core(max_streams=max_streams, ping_interval=ping_interval,
                                ping_timeout=ping_timeout)
        self.calls: dict[int, trio.CancelScope] = {}
        self.ended: ConnectionEnded | None = None
        self.since = time.time()
        self.last_rtt: float | None = None
        self._dirty = trio.Event()
        self._rearmed = trio.Event()  # the core's deadline moved earlier (a ping answered)
        self._progress = trio.Event()
        self._flushed = trio.Event()
        self._idle = trio.Event()
        self._closed = trio.Event()
        self._broken = False
        self._cut: str | None = None  # the message of the calls a shut has cancelled
        self._nursery: trio.Nursery | None = None

    @property
    def open_streams(self) -> int:
        return self.core.open_streams

    async def serve(self) -> ConnectionEnded:
        """Until the connection ends; what ended it."""
        self.core.start(trio.current_time())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._ticker)
                nursery.start_soon(self._reader)
                self._wake()
        finally:
            with trio.CancelScope(shield=True):
                await self._linger()
                await self.tls.aclose()
            self._closed.set()
        assert self.ended is not None
        return self.ended

    async def _linger(self) -> None:
        """After our GOAWAY, the peer's bytes read (and dropped) until its EOF, for LINGER s at
        most: closed with bytes unread, the socket would be reset and our GOAWAY lost with it."""
        ended = self.core.ended
        if self._broken or ended is None or ended.reason == EOF_REASON:
            return
        with trio.move_on_after(LINGER):
            try:
                while await self.tls.receive():
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    # -- the loop ------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._dirty.set()

    def _send_out(self) -> None:
        """What the core has to send, written now; the writer woken for what the socket did
        not take."""
        data = self.core.data_to_send()
        if data:
            self.tls.write(data)
        if self.tls.pending:
            self._wake()

    def _broke(self, exc: Exception) -> None:
        self._broken = True
        self._end(ConnectionEnded(0, f"the connection broke: {exc}", by_peer=True))

    async def _writer(self) -> None:
        while True:
            try:
                self._send_out()
                await self.tls.flush()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._broke(exc)
                return
            self._flushed.set()
            if self.core.ended is not None and not self._dirty.is_set():
                self._end(self.core.ended)  # what it gave meanwhile (a GOAWAY) went out first
                return
            await self._dirty.wait()
            self._dirty = trio.Event()

    async def _reader(self) -> None:
        while self.core.ended is None:
            try:
                data = await self.tls.receive()
                self._events(self.core.receive(data, trio.current_time()))
                self._send_out()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._broke(exc)
                return
            self._progress.set()
            self._progress = trio.Event()
            if len(self.tls.pending) > MAX_PENDING:
                self._flushed = trio.Event()
                await self._flushed.wait()
        self._wake()  # the writer ends the connection

    async def _ticker(self) -> None:
        while self.core.ended is None:
            with trio.move_on_at(self.core.deadline()):
                await self._rearmed.wait()  # an answered ping: the next one is due sooner
            self._rearmed = trio.Event()
            self._events(self.core.tick(trio.current_time()))
            self._wake()

    def _events(self, events: Sequence[object]) -> None:
        for event in events:
            if isinstance(event, CallStarted):
                now = self.dispatcher.answer_now(event.path, event.body)
                if now is not None and now.items is None:  # a plain read: no task, no trip
                    self.core.answer(event.stream_id, now.code, now.message, now.body,
                                     http_status=now.http_status)
                    continue
                assert self._nursery is not None
                self._nursery.start_soon(self._call, event.stream_id, event.path, event.body)
            elif isinstance(event, StreamGone):
                scope = self.calls.get(event.stream_id)
                if scope is not None:
                    scope.cancel()
            elif isinstance(event, PingAnswered):
                self.last_rtt = event.rtt
                self._rearmed.set()
            elif isinstance(event, ConnectionEnded):
                self.ended = event
                if not event.by_peer or event.code:
                    log.info("node connection ended: %s", event.reason)

    def _end(self, ended: ConnectionEnded) -> None:
        if self.ended is None:
            self.ended = ended
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- calls ---------------------------------------------------------------------------------

    async def _call(self, sid: int, path: str, body: bytes) -> None:
        answer: Answer | None = None
        opened = False
        try:
            with trio.CancelScope() as scope:
                self.calls[sid] = scope
                try:
                    answer = await self.dispatcher.call(path, body)
                    if answer.items is None:
                        self.core.answer(sid, answer.code, answer.message, answer.body,
                                         http_status=answer.http_status)
                    else:
                        opened = True
                        await self._stream(sid, answer)
                except FeosError as exc:
                    self._fail(sid, opened, exc.code, exc.message)
                finally:
                    if answer is not None and answer.items is not None:
                        answer.items.close()
            if scope.cancelled_caught and self._cut is not None:
                self._fail(sid, opened, Code.UNAVAILABLE, self._cut)
        finally:
            del self.calls[sid]
            self._wake()
            if not self.calls:
                self._idle.set()

    def _fail(self, sid: int, opened: bool, code: Code, message: str) -> None:
        if opened:
            self.core.end_stream(sid, code, message)
        else:
            self.core.answer(sid, code, message)

    async def _stream(self, sid: int, answer: Answer) -> None:
        assert answer.items is not None
        assert answer.body is not None
        self.core.open_stream(sid, answer.body)
        self._wake()
        while self.core.has(sid):
            item = await answer.items.next()
            if item is None:
                self.core.end_stream(sid, Code.OK, "")
                return
            self.core.send_item(sid, item)
            self._wake()
            while self.core.has(sid) and self.core.buffered(sid) > STREAM_BUFFER:
                await self._progress.wait()

    # -- the end -------------------------------------------------------------------------------

    async def shut(self, grace: float, message: str) -> None:
        """GOAWAY; the calls in flight `grace` s to end; the rest answered UNAVAILABLE
        `message`; the connection closed within CLOSE_WITHIN s of that."""
        if self.ended is None:
            self.core.drain()
            self._wake()
            if self.calls:
                self._idle = trio.Event()
                with trio.move_on_after(grace):
                    await self._idle.wait()
            self._cut = message
            with trio.move_on_after(CLOSE_WITHIN):
                for scope in list(self.calls.values()):
                    scope.cancel()
                while self.calls and not self._closed.is_set():
                    self._idle = trio.Event()
                    await self._idle.wait()
                self.core.close()
                self._wake()
                await self._closed.wait()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


# -- the dialers -------------------------------------------------------------------------------


@attrs.define
class _Dialer:
    target: Target
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    state: str = "starting"
    conn: Connection | None = None
    last_error: str = ""
    redial_at: float | None = None  # time.monotonic()
    renew: trio.Event = attrs.Factory(trio.Event)


class NodeConnections:
    """The node connections to the control plane's instances, on the link's trio run.

    `set_targets` and `set_ssl_context` are called on the link's run; `info` reads plain values
    and may be called from any thread."""

    def __init__(self, dispatcher: Dispatcher, *, max_streams: int = 1024,
                 ping_interval: float = 10.0, ping_timeout: float = 20.0,
                 alpn: str = ALPN) -> None:
        self.dispatcher = dispatcher
        self.max_streams = max_streams
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.alpn = alpn
        self._ctx: ssl.SSLContext | None = None
        self._verify: Callable[[ssl.SSLObject], None] | None = None
        self._have_ctx = trio.Event()
        self._dialers: dict[Target, _Dialer] = {}
        self._draining: set[Connection] = set()
        self._nursery: trio.Nursery | None = None
        self._stopping = False
        self._stopped = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Dial and serve until `stop` has ended every connection."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for dialer in self._dialers.values():
                nursery.start_soon(self._dial, dialer)
            task_status.started()
            await self._stopped.wait()
            nursery.cancel_scope.cancel()

    def set_targets(self, targets: Sequence[Target]) -> None:
        """Dial the new targets; the connections of those gone are shut (30 s for their calls)."""
        if self._stopping:
            return
        wanted = list(dict.fromkeys(targets))
        for target in list(self._dialers):
            if target not in wanted:
                dialer = self._dialers.pop(target)
                dialer.scope.cancel()
                if dialer.conn is not None:
                    self._shut_later(dialer.conn, "the control plane no longer lists "
                                     f"{target.host}:{target.port}")
        for target in wanted:
            if target not in self._dialers:
                dialer = self._dialers[target] = _Dialer(target)
                if self._nursery is not None:
                    self._nursery.start_soon(self._dial, dialer)

    def set_ssl_context(self, ctx: ssl.SSLContext,
                        verify: Callable[[ssl.SSLObject], None] | None = None) -> None:
        """New connections use `ctx`; `verify` is called after each handshake, before any
        HTTP/2 byte, and refuses the peer by raising. Connections made with an earlier context
        are shut (30 s for their calls) and dialed anew at once."""
        renewal = self._ctx is not None
        self._ctx, self._verify = ctx, verify
        self._have_ctx.set()
        if renewal:
            for dialer in self._dialers.values():
                dialer.renew.set()

    async def stop(self, grace: float) -> None:
        """The stop: GOAWAY everywhere, no more dials, the calls in flight `grace` s to end,
        the rest answered UNAVAILABLE, every connection closed within 5 s of that."""
        self._stopping = True
        conns = [d.conn for d in self._dialers.values() if d.conn is not None]
        conns += self._draining
        for dialer in self._dialers.values():
            dialer.state = "stopped"
            dialer.scope.cancel()
        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(conn.shut, grace, stop_message(grace))
        self._stopped.set()

    def info(self) -> list[dict[str, Any]]:
        """For feosctl host control-plane: a row per target."""
        now = time.monotonic()
        rows = []
        for dialer in list(self._dialers.values()):
            conn = dialer.conn
            redial = None
            if dialer.redial_at is not None:
                redial = max(0.0, dialer.redial_at - now)
            rows.append({
                "target": f"{dialer.target.host}:{dialer.target.port}",
                "serverName": dialer.target.server_name,
                "state": dialer.state,
                "openStreams": conn.open_streams if conn is not None else 0,
                "connectedSince": conn.since if conn is not None else None,
                "lastError": dialer.last_error,
                "redialIn": redial,
            })
        return rows

    # -- dialing -------------------------------------------------------------------------------

    def _shut_later(self, conn: Connection, why: str) -> None:
        if self._nursery is None:
            return
        self._draining.add(conn)

        async def shut() -> None:
            try:
                await conn.shut(DRAIN_GRACE, f"the connection closes: {why}")
            finally:
                self._draining.discard(conn)

        self._nursery.start_soon(shut)

    async def _dial(self, dialer: _Dialer) -> None:
        delay = FIRST_REDIAL
        with dialer.scope:
            while not self._stopping:
                if self._ctx is None:
                    dialer.state = "waiting for the node's certificate"
                    await self._have_ctx.wait()
                    continue
                dialer.state, dialer.redial_at = "connecting", None
                dialer.renew = trio.Event()
                try:
                    conn = await self._connect(dialer.target, self._ctx, self._verify)
                except (OSError, ssl.SSLError, trio.BrokenResourceError, trio.TooSlowError,
                        FeosError, ValueError) as exc:
                    dialer.last_error = _describe(exc)
                    log.warning("node connection to %s:%s: %s", dialer.target.host,
                                dialer.target.port, dialer.last_error)
                else:
                    delay = FIRST_REDIAL
                    if await self._serve(dialer, conn):
                        continue  # renewed: dial anew at once
                if self._stopping:
                    return
                dialer.state = "waiting to redial"
                dialer.redial_at = time.monotonic() + delay
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_REDIAL)

    async def _serve(self, dialer: _Dialer, conn: Connection) -> bool:
        """Serve `conn` until it ends (False) or a renewal shuts it (True)."""
        dialer.conn, dialer.state = conn, "connected"
        assert self._nursery is not None
        done = trio.Event()

        async def serve() -> None:
            try:
                ended = await conn.serve()
                if dialer.conn is conn:
                    dialer.last_error = ended.reason
            finally:
                done.set()

        self._nursery.start_soon(serve)
        async with trio.open_nursery() as waits:
            async def renewed() -> None:
                await dialer.renew.wait()
                waits.cancel_scope.cancel()

            async def ended() -> None:
                await done.wait()
                waits.cancel_scope.cancel()

            waits.start_soon(renewed)
            waits.start_soon(ended)
        if self._stopping:
            return False  # the stop owns the connection now: it shuts it
        dialer.conn = None
        if done.is_set():
            return False
        self._shut_later(conn, "the node's certificate was renewed")
        return True

    async def _connect(self, target: Target, ctx: ssl.SSLContext,
                       verify: Callable[[ssl.SSLObject], None] | None) -> Connection:
        tcp = await trio.open_tcp_stream(target.host, target.port)
        try:
            tune_socket(tcp.socket)
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        tls = TLSSocket.from_trio(tcp, ctx, server_hostname=target.server_name)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await tls.handshake()
            chosen = tls.selected_alpn_protocol()
            if chosen != self.alpn:
                raise FeosError(Code.UNAVAILABLE,
                                f"the control plane chose ALPN {chosen!r}, not {self.alpn}")
            if verify is not None:
                try:
                    verify(tls.ssl_object)
                except Exception as exc:
                    raise FeosError(Code.PERMISSION_DENIED,
                                    f"the control plane's certificate is refused: {exc}") from exc
        except BaseException:
            tls.close()
            raise
        return Connection(tls, self.dispatcher, max_streams=self.max_streams,
                          ping_interval=self.ping_interval, ping_timeout=self.ping_timeout)


def tune_socket(sock: Any) -> None:
    """Keepalive and TCP_USER_TIMEOUT 20 s: a dead peer is found by the kernel too."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FeosError):
        return exc.message
    if isinstance(exc, trio.TooSlowError):
        return f"the TLS handshake took over {HANDSHAKE_TIMEOUT:g}s"
    return str(exc) or type(exc).__name__

