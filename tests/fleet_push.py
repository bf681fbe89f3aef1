"""The control plane's side of node connections, for tests and the bench: a TLS listener that
takes the connection a node dials (ALPN feos-node/1, trustme's certificates) and an HTTP/2 client
on it (h2, client side) that pushes calls: `call(service, method, params) -> results dict`,
concurrent calls, a stream read item by item, a stream reset.

`PushListener(ca)`: `ssl_context_for_node()` is the context the node dials with (it trusts the
CA and shows a node certificate of the CA); `serve()` accepts; `accept()` is the next node's
connection as a `PushClient`. `PushClient.run` is its loop (start it in a nursery).

The listener does TLS with feos.fleet's TLSSocket, as the node does, so that the bench measures
the node's side rather than trio.SSLStream's in the control plane. A call alone on the
connection is written at once by its task; calls made while others are in flight are written by
the writer task, all of a turn's together.
"""

from __future__ import annotations

import functools
import ssl
import struct
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio
import trustme
from fleet_ngclient import NgClientConnection

from feos._names import camel
from feos.errors import Code, FeosError
from feos.fleet._calls import INTERFACES, PULLS, _struct
from feos.fleet._tls import TLSSocket

ALPN = "feos-node/1"
SERVER_NAME = "control-plane.feos.test"
ITEM = struct.Struct(">I")
SEND_EVERY = 64  # calls queued in one turn sent by their task: the node starts on them sooner


@functools.cache
def results_module(service: str, method: str) -> Any:
    m = INTERFACES[service]().schema.methods[method]
    return _struct(m.result_type, f"{method}$Results")


@functools.cache
def params_module(service: str, method: str) -> Any:
    m = INTERFACES[service]().schema.methods[method]
    return _struct(m.param_type, f"{method}$Params")


def params_body(service: str, method: str, params: Mapping[str, Any]) -> bytes:
    return bytes(params_module(service, method).new_message(**params).to_bytes())


def decode(module: Any, body: bytes) -> dict[str, Any]:
    with module.from_bytes(body) as reader:
        found: dict[str, Any] = reader.to_dict()
        return found


def status_of(trailers: Mapping[bytes, bytes]) -> tuple[Code, str]:
    code = Code(int(trailers.get(b"feos-status", b"2")))
    return code, unquote(trailers.get(b"feos-message", b"").decode())


@attrs.define
class Response:
    """A stream's answer as it came: headers, body, trailers (the trailers-only answer's
    headers are its trailers too), the RST_STREAM code if the node reset it."""

    headers: dict[bytes, bytes] = attrs.Factory(dict)
    body: bytearray = attrs.Factory(bytearray)
    trailers: dict[bytes, bytes] = attrs.Factory(dict)
    reset: int | None = None

    @property
    def status(self) -> tuple[Code, str]:
        return status_of(self.trailers or self.headers)


@attrs.frozen
class GoAway:
    error_code: int
    last_stream_id: int
    additional_data: bytes


@attrs.define
class _Pending:
    response: Response = attrs.Factory(Response)
    done: trio.Event = attrs.Factory(trio.Event)
    progress: trio.Event = attrs.Factory(trio.Event)


class _Counted(h2.connection.H2Connection):
    """h2's client, its open streams counted by the client (h2 walks them all per stream)."""

    count: Any

    @property
    def open_outbound_streams(self) -> int:
        return int(self.count())


class StreamWire:
    """A trio stream as a TLSSocket is used here: write now, flush later."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.pending = bytearray()

    async def receive(self) -> bytes:
        return bytes(await self.stream.receive_some(256 * 1024))

    def write(self, data: bytes) -> None:
        self.pending += data

    async def flush(self) -> None:
        data, self.pending = bytes(self.pending), bytearray()
        if data:
            await self.stream.send_all(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class PushClient:
    """The control plane's HTTP/2 client on one node connection (a TLSSocket, or any trio
    stream)."""

    def __init__(self, stream: TLSSocket | trio.abc.Stream, *, http2: str = "h2") -> None:
        self.wire = stream if isinstance(stream, TLSSocket) else StreamWire(stream)
        self.h2: Any
        if http2 == "nghttp2":  # the bench's: tests/fleet_ngclient.py
            self.h2 = NgClientConnection(window=4 * 1024 * 1024)
        elif http2 == "h2":
            # the node validates what it takes; the control plane's side need not check itself
            self.h2 = _Counted(h2.config.H2Configuration(
                client_side=True, header_encoding=None, validate_outbound_headers=False,
                normalize_outbound_headers=False))
            self.h2.count = lambda: 0 if self.ignore_limit else len(self._pending)
            self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4 * 1024 * 1024,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            })
        else:
            raise ValueError(f"http2 is {http2!r}: h2 or nghttp2")
        self._pending: dict[int, _Pending] = {}
        self._send_lock = trio.Lock()
        self._dirty = trio.Event()
        self._slots = trio.Semaphore(100)  # until the node's SETTINGS say more
        self._settled = trio.Event()
        self.goaway: GoAway | None = None
        self._frames = bytearray()
        self._raw = b""
        self.closed = trio.Event()
        self.answer_pings = True
        self.pings_seen = 0
        self.received = 0  # bytes the node sent
        self.ignore_limit = False  # open streams past the node's MAX_CONCURRENT_STREAMS
        self._unsent = 0  # calls queued for the writer

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(64 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer)
            self._dirty.set()
            task_status.started()
            try:
                await self._reader()
            finally:
                self.closed.set()
                for pending in self._pending.values():
                    pending.done.set()
                    pending.progress.set()
                nursery.cancel_scope.cancel()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            try:
                self._send_now()
                await self.wire.flush()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    def _send_now(self) -> None:
        self._unsent = 0
        data = self.h2.data_to_send() + self._raw
        self._raw = b""
        if data:
            self.wire.write(data)

    def send_raw(self, data: bytes) -> None:
        """Bytes sent as they are, after what h2 has to send (garbage, for the tests)."""
        self._raw += data
        self._dirty.set()

    async def _reader(self) -> None:
        while True:
            try:
                data = await self.wire.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self.received += len(data)
            data = self._filter(data)
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                self._dirty.set()
                return
            for event in events:
                self._on(event)
            self._answer_now()

    def _answer_now(self) -> None:
        """What the node's bytes made us say (WINDOW_UPDATEs, acks), sent by the reader when
        the wire is a TLSSocket: the writer is woken only for what the socket did not take."""
        if isinstance(self.wire, TLSSocket) and not self._raw:
            try:
                self._send_now()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader sees the end
            if not self.wire.pending:
                return
        self._dirty.set()

    def _on(self, event: h2.events.Event) -> None:
        sid = getattr(event, "stream_id", None)
        pending = self._pending.get(sid) if sid else None
        if isinstance(event, h2.events.RemoteSettingsChanged):
            limit = self.h2.remote_settings.max_concurrent_streams
            if not self._settled.is_set():
                self._settled.set()
                self._slots = trio.Semaphore(min(limit, 10_000))
        elif isinstance(event, h2.events.PingReceived):
            self.pings_seen += 1
        elif pending is None:
            return
        elif isinstance(event, h2.events.ResponseReceived):
            pending.response.headers = dict(event.headers or ())
        elif isinstance(event, h2.events.DataReceived):
            pending.response.body += event.data or b""
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            pending.progress.set()
            pending.progress = trio.Event()
        elif isinstance(event, h2.events.TrailersReceived):
            pending.response.trailers = dict(event.headers or ())
        elif isinstance(event, h2.events.StreamEnded):
            pending.done.set()
            pending.progress.set()
        elif isinstance(event, h2.events.StreamReset):
            pending.response.reset = event.error_code
            pending.done.set()
            pending.progress.set()

    def _filter(self, data: bytes) -> bytes:
        """Whole frames for h2, less the GOAWAYs (kept in `goaway`: h2's client closes its side
        on one and would read no answer of the calls the node still ends) and, while
        `answer_pings` is off, the node's pings."""
        self._frames += data
        out = bytearray()
        at = 0
        while at + 9 <= len(self._frames):
            length = int.from_bytes(self._frames[at:at + 3], "big")
            end = at + 9 + length
            if end > len(self._frames):
                break
            kind, flags = self._frames[at + 3], self._frames[at + 4]
            if kind == 7 and length >= 8:
                payload = bytes(self._frames[at + 9:end])
                self.goaway = GoAway(int.from_bytes(payload[4:8], "big"),
                                     int.from_bytes(payload[:4], "big") & 0x7FFFFFFF,
                                     payload[8:])
                # streams above its last stream id were not taken (RFC 9113 6.8), whether or
                # not their RST_STREAM REFUSED_STREAM has come
                for sid, pending in self._pending.items():
                    if sid > self.goaway.last_stream_id and not pending.done.is_set():
                        pending.response.reset = 7  # REFUSED_STREAM: not processed
                        pending.done.set()
                        pending.progress.set()
            elif not (kind == 6 and not flags & 1 and not self.answer_pings):
                out += self._frames[at:end]
            at = end
        del self._frames[:at]
        return bytes(out)

    # -- calls ---------------------------------------------------------------------------------

    async def request(self, path: str, body: bytes, *, method: bytes = b"POST",
                      end: bool = True) -> tuple[int, _Pending]:
        """A stream opened with the call's headers and body."""
        if not self._settled.is_set():
            await self._settled.wait()
        if not self.ignore_limit:
            try:
                self._slots.acquire_nowait()  # no checkpoint: a call alone goes out at once
            except trio.WouldBlock:
                await self._slots.acquire()
        sid = self.h2.get_next_available_stream_id()
        pending = self._pending[sid] = _Pending()
        self.h2.send_headers(sid, [(b":method", method), (b":scheme", b"https"),
                                   (b":authority", b"node"), (b":path", path.encode()),
                                   (b"content-type", b"application/x-capnp")],
                             end_stream=not body and end)
        if body:
            self._send_body(sid, body, end)
        self._unsent += 1
        if isinstance(self.wire, TLSSocket) and (len(self._pending) == 1
                                                 or self._unsent >= SEND_EVERY):
            try:
                self._send_now()  # alone, or a batch: no hop to the writer
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader sees the end
            if self.wire.pending or self._unsent:
                self._dirty.set()
        else:
            self._dirty.set()
        return sid, pending

    def _send_body(self, sid: int, body: bytes, end: bool) -> None:
        size = self.h2.max_outbound_frame_size
        for at in range(0, len(body), size):
            last = at + size >= len(body)
            self.h2.send_data(sid, body[at:at + size], end_stream=last and end)

    async def finish(self, sid: int, pending: _Pending) -> Response:
        try:
            await pending.done.wait()
        finally:
            self._release(sid)
        return pending.response

    def _release(self, sid: int) -> None:
        if self._pending.pop(sid, None) is not None and not self.ignore_limit:
            self._slots.release()

    async def raw(self, path: str, body: bytes, *, method: bytes = b"POST") -> Response:
        sid, pending = await self.request(path, body, method=method)
        return await self.finish(sid, pending)

    async def call(self, service: str, method: str, params: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
        """The results dict (its status from the trailers when the answer has no body)."""
        response = await self.raw(f"/{service}/{method}",
                                  params_body(service, method, params or {}))
        return results_of(response, results_module(service, method))

    async def call_ok(self, service: str, method: str,
                      params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The results, or the FeosError of their status."""
        results = await self.call(service, method, params)
        raise_for(results)
        return results

    @asynccontextmanager
    async def stream_call(self, service: str, method: str,
                          params: Mapping[str, Any]) -> AsyncIterator[PushStream]:
        sid, pending = await self.request(f"/{service}/{method}",
                                          params_body(service, method, params))
        stream = PushStream(self, sid, pending, results_module(service, method),
                            _item_module(service, method))
        try:
            yield stream
        finally:
            if not pending.done.is_set():
                self.reset(sid)
            self._release(sid)

    def reset(self, sid: int, code: int = 8) -> None:
        """RST_STREAM (CANCEL by default)."""
        try:
            self.h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            pass
        self._dirty.set()

    async def aclose(self) -> None:
        try:
            self.h2.close_connection()
        except h2.exceptions.ProtocolError:
            pass
        with trio.move_on_after(2):
            try:
                self._send_now()
                await self.wire.flush()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await self.wire.aclose()


def results_of(response: Response, module: Any) -> dict[str, Any]:
    code, message = response.status
    if response.body and response.headers.get(b"content-type") == b"application/x-capnp":
        results = decode(module, bytes(response.body))
    else:
        results = {}
    results["status"] = {"code": camel(code.name.lower()), "message": message}
    if response.reset is not None:
        results["reset"] = response.reset
    return results


def raise_for(results: Mapping[str, Any]) -> None:
    status = results["status"]
    code = Code[_snake_upper(status["code"])]
    if code != Code.OK:
        raise FeosError(code, status["message"])


def _snake_upper(name: str) -> str:
    return "".join("_" + c if c.isupper() else c for c in name).upper()


def _item_module(service: str, method: str) -> Any:
    """The results of the pulls of a stream method's capability (EventStream.next, ...)."""
    m = INTERFACES[service]().schema.methods[method]
    for field in m.result_type.fields_list:
        if field.proto.slot.type.which() == "interface":
            iface = field.schema  # the capability's interface schema
            name = str(iface.node.displayName).rsplit(":", 1)[-1].rsplit(".", 1)[-1]
            pull = PULLS[name][0]
            return _struct(iface.methods[pull].result_type, f"{pull}$Results")
    raise ValueError(f"{service}.{method} answers no stream")


class PushStream:
    """A long-lived answer read item by item: `first` (the method's results), then `item()`
    until None, then `status` from the trailers."""

    def __init__(self, client: PushClient, sid: int, pending: _Pending, first: Any,
                 item: Any) -> None:
        self.client = client
        self.sid = sid
        self.pending = pending
        self._first_module = first
        self._item_module = item
        self._at = 0
        self._first_read = False

    async def _next_message(self) -> bytes | None:
        body = self.pending.response.body
        while True:
            if len(body) - self._at >= ITEM.size:
                (size,) = ITEM.unpack_from(body, self._at)
                if len(body) - self._at - ITEM.size >= size:
                    start = self._at + ITEM.size
                    self._at = start + size
                    return bytes(body[start:self._at])
            if self.pending.done.is_set():
                return None
            await self.pending.progress.wait()

    async def first(self) -> dict[str, Any]:
        """The method's results; or, for a trailers-only answer, its status alone."""
        self._first_read = True
        if self.pending.response.headers == {}:
            while not self.pending.response.headers and not self.pending.done.is_set():
                await self.pending.progress.wait()
        if self.pending.response.headers.get(b"content-type") != b"application/x-capnp-stream":
            await self.pending.done.wait()
            return results_of(self.pending.response, self._first_module)
        message = await self._next_message()
        first = decode(self._first_module, message) if message is not None else {}
        first.setdefault("status", {"code": "ok", "message": ""})
        return first

    async def item(self) -> dict[str, Any] | None:
        """The next item (a pull's results), or None at the stream's end."""
        if not self._first_read:
            await self.first()
        message = await self._next_message()
        return decode(self._item_module, message) if message is not None else None

    @property
    def status(self) -> tuple[Code, str]:
        return self.pending.response.status

    def reset(self) -> None:
        self.client.reset(self.sid)


# -- the listener ------------------------------------------------------------------------------


class PushListener:
    """The control plane's TLS port for node connections (trustme's CA)."""

    def __init__(self, ca: trustme.CA | None = None, *, alpn: str = ALPN,
                 server_name: str = SERVER_NAME, http2: str = "h2") -> None:
        self.http2 = http2  # the clients' HTTP/2: h2's, or libnghttp2's (the bench's)
        self.ca = ca or trustme.CA()
        self.server_name = server_name
        self.cert = self.ca.issue_cert(server_name)
        self.server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.cert.configure_cert(self.server_ctx)
        self.ca.configure_trust(self.server_ctx)
        self.server_ctx.verify_mode = ssl.CERT_REQUIRED
        self.server_ctx.set_alpn_protocols([alpn])
        self.port = 0
        self._send, self._receive = trio.open_memory_channel[PushClient](64)
        self.accepted = 0

    def ssl_context_for_node(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.ca.configure_trust(ctx)
        self.ca.issue_cert("node.feos.test").configure_cert(ctx)
        ctx.set_alpn_protocols([ALPN])
        return ctx

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(self._take, listeners, handler_nursery=nursery)

    async def _take(self, tcp: trio.SocketStream) -> None:
        """One node connection, its socket closed however it ends (serve_listeners closes
        none: a connection the test never took would be left to the garbage collector)."""
        tls = TLSSocket.from_trio(tcp, self.server_ctx, server_side=True)
        try:
            try:
                with trio.fail_after(10):
                    await tls.handshake()
            except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError):
                return
            self.accepted += 1
            client = PushClient(tls, http2=self.http2)
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                await self._send.send(client)
        finally:
            tls.close()

    async def accept(self) -> PushClient:
        """The next node connection, its HTTP/2 client running."""
        return await self._receive.receive()


# -- the node's side, for tests and the bench ----------------------------------------------------


class LinkThread:
    """`NodeConnections` on a trio run of its own in a thread, as feosd's link runs them; the
    test's run plays feosd's runtime. `async with LinkThread(conns)`; `on_link(fn, ...)` runs a
    trio function there, `on_link_sync(fn, ...)` a plain one."""

    def __init__(self, conns: Any) -> None:
        self.conns = conns
        self.token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._error: list[BaseException] = []
        self.stopped = False

    async def __aenter__(self) -> LinkThread:
        main = trio.lowlevel.current_trio_token()
        started = trio.Event()

        async def run() -> None:
            self.token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.conns.run)
                main.run_sync_soon(started.set)

        def thread() -> None:
            try:
                trio.run(run)
            except BaseException as exc:  # handed to the test at the exit
                self._error.append(exc)
                main.run_sync_soon(started.set)

        self._thread = threading.Thread(target=thread, name="link", daemon=True)
        self._thread.start()
        await started.wait()
        if self._error:
            raise self._error[0]
        return self

    async def on_link(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(
            functools.partial(trio.from_thread.run, fn, *args, trio_token=self.token))

    async def on_link_sync(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(
            functools.partial(trio.from_thread.run_sync, fn, *args, trio_token=self.token))

    async def stop(self, grace: float) -> None:
        self.stopped = True
        await self.on_link(self.conns.stop, grace)

    async def __aexit__(self, *exc: object) -> None:
        assert self._thread is not None
        if not self.stopped and not self._error:
            with trio.CancelScope(shield=True):
                await self.stop(0.5)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._thread.join, 10)
        if self._error:
            raise self._error[0]
