"""The uplink's HTTP/2 client: one TLS connection (ALPN h2), one call at a time, on trio.

A call is one stream, as on the node connections (docs/node-connections.md), with their codec
(feos.fleet._calls): POST
/<service>/<method> with the method's parameters as one Cap'n Proto message, the answer's body
the results, its trailers the status (feos-status, the code's number, and feos-message, its text
percent-encoded). The uplink makes one call at a time, so the client reads its connection only
while a call waits: the server's pings and settings are answered then.

`dial` opens the TCP connection (keepalive, TCP_USER_TIMEOUT), does the TLS handshake and runs the
`verify` check on it before any HTTP/2 byte leaves, then sends the connection preface.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio

from ..errors import Code, FeosError
from ._calls import _struct
from ._calls import decode as decode
from ._calls import encode as encode_message
from ._h2server import CONTENT_TYPE
from ._verify import tune_socket

READ_SIZE = 65536


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise FeosError(Code.INVALID_ARGUMENT, f"{address}: not HOST:PORT")
    return host.strip("[]"), int(port)


def params_type(interface: Any, method: str) -> Any:
    return _struct(interface.schema.methods[method].param_type, f"{method}$Params")


def results_type(interface: Any, method: str) -> Any:
    return _struct(interface.schema.methods[method].result_type, f"{method}$Results")


def encode(struct: Any, values: dict[str, Any]) -> bytes:
    """One message of `values`, as the node connections write theirs (one codec for both)."""
    data, _ = encode_message(struct, values)
    return data


def status_error(headers: dict[bytes, bytes]) -> FeosError | None:
    """The FeosError a call's trailers (or headers, for a call refused at once) stand for."""
    raw = headers.get(b"feos-status")
    if raw is None:
        status = headers.get(b":status", b"200")
        if status == b"200":
            return FeosError(Code.INTERNAL, "the answer carries no feos-status")
        return FeosError(Code.UNAVAILABLE, f"the control plane answered HTTP {status.decode()}")
    try:
        code = Code(int(raw))
    except ValueError:
        code = Code.UNKNOWN
    if code == Code.OK:
        return None
    return FeosError(code, urllib.parse.unquote(headers.get(b"feos-message", b"").decode()))


class H2Client:
    def __init__(self, stream: trio.abc.Stream, authority: str) -> None:
        self.stream = stream
        self.authority = authority
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.closed = False

    async def start(self) -> None:
        self.conn.initiate_connection()
        await self._flush()

    async def call(self, path: str, body: bytes) -> bytes:
        """The answer's body; a FeosError for a status other than OK or a lost connection."""
        if self.closed:
            raise FeosError(Code.UNAVAILABLE, "the uplink's connection is closed")
        try:
            return await self._call(path, body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                h2.exceptions.ProtocolError) as exc:
            self.closed = True
            raise FeosError(Code.UNAVAILABLE, f"the uplink's connection: {exc!r}") from None

    async def _call(self, path: str, body: bytes) -> bytes:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"),
                                     (b":authority", self.authority.encode()),
                                     (b":path", path.encode()),
                                     (b"content-type", CONTENT_TYPE)])
        await self._send_body(sid, body)
        headers: dict[bytes, bytes] = {}
        answer = bytearray()
        while True:
            for event in await self._events():
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived) \
                        and event.stream_id == sid:
                    headers.update(dict(event.headers))
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == sid:
                    answer += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == sid:
                    raise FeosError(Code.UNAVAILABLE, f"the control plane reset the call "
                                    f"(HTTP/2 error {event.error_code})")
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.closed = True
                    raise FeosError(Code.UNAVAILABLE, "the control plane closed the connection")
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == sid:
                    await self._flush()
                    error = status_error(headers)
                    if error is not None:
                        raise error
                    return bytes(answer)
            await self._flush()

    async def _send_body(self, sid: int, body: bytes) -> None:
        view = memoryview(body)
        while True:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if room > 0 or not view:
                chunk, view = view[:room], view[room:]
                self.conn.send_data(sid, bytes(chunk), end_stream=not view)
                await self._flush()
                if not view:
                    return
            for event in await self._events():  # a window update, a settings change
                if isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                    raise FeosError(Code.UNAVAILABLE, "the control plane ended the call")

    async def _events(self) -> list[Any]:
        data = await self.stream.receive_some(READ_SIZE)
        if not data:
            self.closed = True
            raise FeosError(Code.UNAVAILABLE, "the control plane closed the connection")
        return list(self.conn.receive_data(data))

    async def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            with trio.move_on_after(1) as scope:
                scope.shield = True
                try:
                    self.conn.close_connection()
                    await self._flush()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                        h2.exceptions.ProtocolError):
                    pass
        await trio.aclose_forcefully(self.stream)


DIAL_S = 10.0


async def dial(address: str, ctx: Any, verify: Callable[[Any], None], server_name: str
               ) -> H2Client:
    """A verified connection to `address`, ready for calls."""
    host, port = split_address(address)
    with trio.fail_after(DIAL_S):
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise FeosError(Code.UNAVAILABLE, f"{address}: {exc.strerror or exc}") from None
        tune_socket(tcp.socket)
        tls = trio.SSLStream(tcp, ctx, server_hostname=server_name)
        try:
            await tls.do_handshake()
            verify(tls._ssl_object)  # before any byte of ours beyond the handshake
            if tls.selected_alpn_protocol() != "h2":
                raise FeosError(Code.UNAVAILABLE, f"{address} did not agree to HTTP/2 (ALPN h2)")
            client = H2Client(tls, server_name)
            await client.start()
        except BaseException as exc:
            await trio.aclose_forcefully(tls)
            if isinstance(exc, trio.BrokenResourceError | OSError):
                raise FeosError(Code.UNAVAILABLE, f"{address}: TLS: {exc!r}") from None
            raise
    return client
