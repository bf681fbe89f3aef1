"""A node connection's HTTP/2, sans-IO: bytes in, events and bytes out (over h2's state machine).

Theory of operation: feosd dials the control plane, but on the connection it is the HTTP/2
server. `ServerCore` wraps h2's server-side H2Connection and turns what the peer sends into the
few events the loop acts on:

- `CallStarted(stream_id, path, body)`: a request has arrived whole (its END_STREAM);
- `StreamGone(stream_id, code, reason)`: a stream whose call was started ended before its
  answer did: the peer reset it, or the core did (its answer could not be sent);
- `PingAnswered(rtt)`: our ping came back;
- `ConnectionEnded(code, reason, by_peer)`: the peer's GOAWAY, a protocol error of the peer
  (answered with a GOAWAY of its code), our ping left unanswered, or our own `close`.

The loop answers a call with `answer` (one message), or `open_stream`, `send_item` and
`end_stream` (a long-lived stream), or `reset`; what the core has to send waits in
`data_to_send()`. `tick(now)` sends our pings and ends the connection when one is not answered
within the timeout; `deadline()` says when the loop must tick next. Time is the caller's.

Nothing the peer sends raises out of the core. A connection error (a frame that does not parse,
one over MAX_FRAME_SIZE, a header block that does not decode or is over the header list's cap,
DATA on a stream that ended, a bad preface) ends the connection with h2's GOAWAY and its error
code; anything else h2 raises on the peer's bytes ends it with INTERNAL_ERROR. Stream errors end
one stream: a stream over MAX_CONCURRENT_STREAMS is refused (RST_STREAM REFUSED_STREAM: its
header block is still decoded, so HPACK stays in step); a body over the cap is answered
RESOURCE_EXHAUSTED and the rest of its upload stopped (RST_STREAM NO_ERROR, RFC 9113 8.1); a
method other than POST is answered 405 INVALID_ARGUMENT. A call on a stream that has gone is a
no-op for the loop: it need not race the peer's resets.

`drain()` is the graceful GOAWAY of a stop: NO_ERROR with the last stream taken, sent beside h2's
state machine (h2 closes its side on a GOAWAY of its own and would answer no stream in flight
after it); streams opened after it are refused, those in flight are answered as usual.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, RstStreamFrame

from ..errors import Code

MAX_STREAMS = 1024
MAX_FRAME_SIZE = 16384  # what we accept; RFC 9113's smallest
MAX_HEADER_LIST = 16 * 1024
MAX_BODY = 16 * 1024 * 1024
STREAM_WINDOW = 1024 * 1024
CONNECTION_WINDOW = 32 * 1024 * 1024

CONTENT_TYPE = b"application/x-capnp"
STREAM_CONTENT_TYPE = b"application/x-capnp-stream"
EOF_REASON = "the peer closed the connection"
ITEM_PREFIX = struct.Struct(">I")  # a stream's item: its length, then a Cap'n Proto message


@attrs.frozen
class CallStarted:
    stream_id: int
    path: str
    body: bytes


@attrs.frozen
class StreamGone:
    stream_id: int
    code: ErrorCodes | int
    reason: str


@attrs.frozen
class PingAnswered:
    rtt: float


@attrs.frozen
class ConnectionEnded:
    code: ErrorCodes | int
    reason: str
    by_peer: bool


Event = CallStarted | StreamGone | PingAnswered | ConnectionEnded


def trailers(code: Code, message: str) -> list[tuple[bytes, bytes]]:
    """A call's status as its trailers: feos-status (the Code's number) and feos-message
    (percent-encoded UTF-8, as grpc-message)."""
    return [(b"feos-status", str(int(code)).encode()),
            (b"feos-message", quote(message, safe=" !\"#$&'()*+,/:;=?@[]^_`{|}~").encode())]


def answer_headers(code: Code, message: str, http_status: int) -> list[tuple[bytes, bytes]]:
    """A whole answer's HEADERS: its status there, as it is known before the body."""
    return [(b":status", str(http_status).encode()), (b"content-type", CONTENT_TYPE),
            *trailers(code, message)]


STREAM_HEADERS = [(b":status", b"200"), (b"content-type", STREAM_CONTENT_TYPE)]


class CoreBase:
    """What ServerCore and feos.fleet._nghttp2's NgServerCore share, word for word: the
    options, the ping's timing, the drain's guard, the end's bookkeeping and the stream table's
    queries. A core sends its own frames: `_send_ping`, `_send_drain` (the drain's GOAWAY) and
    `_end` (which calls `_ended`)."""

    # each core's _Stream: .outbound, the answer's bytes waiting; .closing, its end once they
    # are out (trailers, or [] to end with the last DATA)
    _streams: dict[int, Any]

    def __init__(self, max_streams: int, max_body: int, ping_interval: float,
                 ping_timeout: float) -> None:
        self.max_streams = max_streams
        self.max_body = max_body
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._ping: tuple[bytes, float] | None = None  # ours in flight: its payload, when sent
        self._next_ping = 0.0
        self._drained_at: int | None = None  # the last stream taken once drain() was called
        self.ended: ConnectionEnded | None = None

    def _send_ping(self, payload: bytes) -> None:
        raise NotImplementedError

    def _send_drain(self) -> None:
        """Set _drained_at to the last stream taken and send the GOAWAY (NO_ERROR) of a stop."""
        raise NotImplementedError

    def _end(self, code: ErrorCodes | int, reason: str, *, by_peer: bool,
             goaway: bool) -> ConnectionEnded:
        raise NotImplementedError

    def _ended(self, code: ErrorCodes | int, reason: str, by_peer: bool) -> ConnectionEnded:
        """The connection's end as the core's state: no stream is left to answer."""
        self.ended = ConnectionEnded(code, reason, by_peer)
        self._streams.clear()
        return self.ended

    # -- the connection ------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        """Streams the peer opened whose answer has not gone out whole."""
        return len(self._streams)

    @property
    def draining(self) -> bool:
        return self._drained_at is not None

    def drain(self) -> None:
        """The stop's GOAWAY (NO_ERROR): no new stream is taken, those in flight go on."""
        if self.ended is not None or self._drained_at is not None:
            return
        self._send_drain()

    def close(self, code: ErrorCodes = ErrorCodes.NO_ERROR, reason: str = "closed") -> None:
        """The last GOAWAY; nothing is sent after it."""
        if self.ended is None:
            self._end(code, reason, by_peer=False, goaway=True)

    # -- time ----------------------------------------------------------------------------------

    def deadline(self) -> float:
        """When `tick` must run next."""
        if self._ping is not None:
            return self._ping[1] + self.ping_timeout
        return self._next_ping

    def tick(self, now: float) -> list[Event]:
        """Our ping sent when it is due; the connection ended when it was not answered."""
        if self.ended is not None:
            return []
        if self._ping is not None:
            if now - self._ping[1] < self.ping_timeout:
                return []
            return [self._end(ErrorCodes.NO_ERROR,
                              f"the ping was not answered within {self.ping_timeout:g}s",
                              by_peer=False, goaway=True)]
        if now >= self._next_ping:
            payload = os.urandom(8)
            self._send_ping(payload)
            self._ping = (payload, now)
        return []

    def _ping_answered(self, payload: bytes | None, now: float) -> PingAnswered | None:
        """A PING's ACK: PingAnswered if it is our ping's, and the next one timed from now."""
        if self._ping is None or payload != self._ping[0]:
            return None
        rtt = now - self._ping[1]
        self._ping = None
        self._next_ping = now + self.ping_interval
        return PingAnswered(rtt)

    # -- answers -------------------------------------------------------------------------------

    def send_item(self, stream_id: int, item: bytes) -> None:
        self._queue(stream_id, ITEM_PREFIX.pack(len(item)) + item, None)

    def end_stream(self, stream_id: int, code: Code, message: str) -> None:
        """The stream's status as its trailers, after what it sent."""
        self._queue(stream_id, b"", trailers(code, message))

    def _queue(self, sid: int, data: bytes, closing: list[tuple[bytes, bytes]] | None) -> None:
        """More of a started answer (its end: closing) for the core to send (`_send_more`)."""
        stream = self._streams.get(sid)
        if self.ended is not None or stream is None or stream.closing is not None:
            return
        stream.outbound += data
        stream.closing = closing
        self._send_more(sid, stream)

    def _send_more(self, sid: int, stream: Any) -> None:
        raise NotImplementedError

    def has(self, stream_id: int) -> bool:
        """Whether the stream is still there to be answered."""
        return self.ended is None and stream_id in self._streams

    def buffered(self, stream_id: int) -> int:
        """Bytes of the stream's answer that wait for flow control's window."""
        stream = self._streams.get(stream_id)
        return len(stream.outbound) if stream is not None else 0


class _Refusing(h2.connection.H2Connection):
    """h2's connection, which refuses a stream over the limit rather than the connection, and
    counts its open streams in O(1).

    h2 counts the open streams by walking all of them (dropping the closed ones as it goes) for
    every new stream: a burst of 1,000 calls walks half a million streams. The core knows what
    is open (a stream is its own until the answer went out whole, and one the core let go of is
    closed or reset in h2 too); h2's walk still runs once in PURGE_EVERY new streams, to drop
    the closed ones from its table."""

    PURGE_EVERY = 256
    count: Callable[[], int]
    batch = 0  # new streams of the bytes in hand, which the core has not taken yet
    _since_purge = 0

    @property
    def open_inbound_streams(self) -> int:
        self._since_purge += 1
        if self._since_purge >= self.PURGE_EVERY:
            self._since_purge = 0
            return max(super().open_inbound_streams, self.count() + self.batch)
        return self.count() + self.batch

    def _receive_headers_frame(self, frame):  # type: ignore[no-untyped-def]
        new = frame.stream_id not in self.streams
        try:
            taken = super()._receive_headers_frame(frame)
            self.batch += new
            return taken
        except h2.exceptions.TooManyStreamsError:
            if frame.stream_id % 2 == 0 or frame.stream_id <= self.highest_inbound_stream_id:
                raise
            h2.connection._decode_headers(self.decoder, frame.data)  # HPACK stays in step
            self.highest_inbound_stream_id = frame.stream_id
            # its later frames are those of a stream we reset: a stream error again, not the
            # connection's
            self._closed_streams[frame.stream_id] = h2.stream.StreamClosedBy.SEND_RST_STREAM
            rst = RstStreamFrame(frame.stream_id)
            rst.error_code = ErrorCodes.REFUSED_STREAM
            return [rst], []
        except h2.exceptions.DenialOfServiceError:
            raise  # a header list over the cap: ENHANCE_YOUR_CALM
        except h2.exceptions.ProtocolError as exc:
            if isinstance(exc.__cause__, hpack.HPACKError):
                exc.error_code = ErrorCodes.COMPRESSION_ERROR  # RFC 9113 4.3, not h2's PROTOCOL
            raise


@attrs.define
class _Stream:
    headers: dict[bytes, bytes] = attrs.Factory(dict)
    body: bytearray = attrs.Factory(bytearray)
    started: bool = False  # CallStarted given: the loop owns it until it answers
    outbound: bytearray = attrs.Factory(bytearray)
    # once outbound is out: trailers to send, or [] to end with the last DATA
    closing: list[tuple[bytes, bytes]] | None = None


class ServerCore(CoreBase):
    """One node connection's HTTP/2 server side; see the module's theory of operation."""

    def __init__(self, *, max_streams: int = MAX_STREAMS, max_body: int = MAX_BODY,
                 ping_interval: float = 10.0, ping_timeout: float = 20.0) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                           validate_outbound_headers=False,
                                           normalize_outbound_headers=False)
        self._h2 = _Refusing(config)
        self._h2.count = lambda: len(self._streams)
        self._h2.decoder.max_header_list_size = MAX_HEADER_LIST
        super().__init__(max_streams, max_body, ping_interval, ping_timeout)
        self._streams: dict[int, _Stream] = {}
        self._out = bytearray()

    # -- the connection ------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """The connection's preface: our SETTINGS and the connection's window."""
        self._h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._next_ping = now + self.ping_interval

    def data_to_send(self) -> bytes:
        if self._h2.data_to_send is not None:
            self._out += self._h2.data_to_send()
        out, self._out = bytes(self._out), bytearray()
        return out

    def _send_drain(self) -> None:
        self._drained_at = self._h2.highest_inbound_stream_id
        self._out += self._h2.data_to_send()
        self._out += GoAwayFrame(0, last_stream_id=self._drained_at,
                                 error_code=ErrorCodes.NO_ERROR,
                                 additional_data=b"the node stops").serialize()

    def _end(self, code: ErrorCodes | int, reason: str, *, by_peer: bool,
             goaway: bool) -> ConnectionEnded:
        if goaway:
            try:
                self._h2.close_connection(code, reason.encode()[:256])
            except h2.exceptions.ProtocolError:  # h2 has closed already (it sent its own)
                pass
        return self._ended(code, reason, by_peer)

    def _send_ping(self, payload: bytes) -> None:
        self._h2.ping(payload)

    # -- what the peer sends -------------------------------------------------------------------

    def receive(self, data: bytes, now: float) -> list[Event]:
        """The peer's bytes; the events they make. Never raises."""
        if self.ended is not None:
            return []
        if not data:
            return [self._end(ErrorCodes.NO_ERROR, EOF_REASON,
                              by_peer=True, goaway=False)]
        try:
            h2_events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued its GOAWAY
            return [self._end(exc.error_code, f"protocol error: {exc}", by_peer=True,
                              goaway=False)]
        except Exception as exc:  # what else h2 or hyperframe raise on bytes they cannot take
            return [self._end(ErrorCodes.INTERNAL_ERROR, f"bad input: {exc!r}", by_peer=True,
                              goaway=True)]
        events: list[Event] = []
        try:
            for event in h2_events:
                events.extend(self._on(event, now))
        except h2.exceptions.ProtocolError as exc:
            events.append(self._end(exc.error_code, f"protocol error: {exc}", by_peer=True,
                                    goaway=True))
        self._h2.batch = 0
        return events

    def _on(self, event: h2.events.Event, now: float) -> Iterable[Event]:
        if isinstance(event, h2.events.RequestReceived):
            return self._on_request(event)
        if isinstance(event, h2.events.DataReceived):
            return self._on_data(event)
        if isinstance(event, h2.events.StreamEnded):
            return self._on_end(event.stream_id)
        if isinstance(event, h2.events.StreamReset):
            return self._gone(event.stream_id, event.error_code, "the peer reset the stream")
        if isinstance(event, h2.events.WindowUpdated):
            self._flush_all() if event.stream_id == 0 else self._flush(event.stream_id)
            return ()
        if isinstance(event, h2.events.RemoteSettingsChanged):
            self._flush_all()  # a new initial window may let more out
            return ()
        if isinstance(event, h2.events.PingAckReceived):
            return self._on_ping_ack(event.ping_data, now)
        if isinstance(event, h2.events.ConnectionTerminated):
            reason = (event.additional_data or b"").decode(errors="replace")
            code = event.error_code if event.error_code is not None else ErrorCodes.NO_ERROR
            return [self._end(code, f"the peer's GOAWAY: {reason or code!s}", by_peer=True,
                              goaway=False)]
        return ()  # settings acknowledged, pings (h2 answers them), priorities, unknown frames

    def _on_request(self, event: h2.events.RequestReceived) -> Iterable[Event]:
        sid = event.stream_id
        if self._drained_at is not None and sid > self._drained_at:
            self._reset(sid, ErrorCodes.REFUSED_STREAM)
            return ()
        headers = dict(event.headers or ())
        self._streams[sid] = _Stream(headers=headers)
        if headers.get(b":method") != b"POST":
            self.answer(sid, Code.INVALID_ARGUMENT, "a call is a POST", http_status=405)
        return ()

    def _on_data(self, event: h2.events.DataReceived) -> Iterable[Event]:
        sid = event.stream_id
        self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
        stream = self._streams.get(sid)
        if stream is None or stream.started:
            return ()
        if len(stream.body) + len(event.data or b"") > self.max_body:
            self.answer(sid, Code.RESOURCE_EXHAUSTED,
                        f"the call's body is over {self.max_body} bytes")
            return ()
        stream.body += event.data or b""
        return ()

    def _on_end(self, sid: int) -> Iterable[Event]:
        stream = self._streams.get(sid)
        if stream is None or stream.started:
            return ()
        stream.started = True
        path = stream.headers.get(b":path", b"").decode(errors="replace")
        body, stream.body = bytes(stream.body), bytearray()
        return [CallStarted(sid, path, body)]

    def _on_ping_ack(self, payload: bytes | None, now: float) -> Iterable[Event]:
        answered = self._ping_answered(payload, now)
        return () if answered is None else [answered]

    def _gone(self, sid: int, code: ErrorCodes | int, reason: str) -> Iterable[Event]:
        stream = self._streams.pop(sid, None)
        if stream is None or not stream.started:
            return ()
        return [StreamGone(sid, code, reason)]

    # -- answers -------------------------------------------------------------------------------

    def answer(self, stream_id: int, code: Code, message: str, body: bytes | None = None, *,
               http_status: int = 200) -> None:
        """A call's whole answer: its status in the HEADERS frame (it is known before the body),
        then its results message (if any) in DATA that ends the stream."""
        headers = answer_headers(code, message, http_status)
        if body is None:
            self._send_headers(stream_id, headers, end=True)
            return
        self._send_headers(stream_id, headers)
        self._queue(stream_id, body, [])

    def open_stream(self, stream_id: int, first: bytes) -> None:
        """A long-lived answer: its headers, then the method's results as the first item."""
        self._send_headers(stream_id, STREAM_HEADERS)
        self.send_item(stream_id, first)

    def reset(self, stream_id: int, code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        """End a stream without an answer (the loop's own: no StreamGone follows)."""
        if self._streams.pop(stream_id, None) is not None:
            self._reset(stream_id, code)

    def _reset(self, sid: int, code: ErrorCodes) -> None:
        if self.ended is not None:
            return
        try:
            self._h2.reset_stream(sid, code)
        except (h2.exceptions.ProtocolError, KeyError):
            pass  # the stream had closed: nothing to end

    def _send_headers(self, sid: int, headers: list[tuple[bytes, bytes]],
                      end: bool = False) -> None:
        if self.ended is not None or sid not in self._streams:
            return
        try:
            self._h2.send_headers(sid, headers, end_stream=end)
        except (h2.exceptions.ProtocolError, KeyError):
            self._streams.pop(sid, None)  # the peer's reset crossed our answer
            return
        if end:
            self._finish(sid)

    def _send_more(self, sid: int, stream: _Stream) -> None:
        self._flush(sid)

    def _flush_all(self) -> None:
        for sid in [s for s, st in self._streams.items() if st.outbound or st.closing]:
            self._flush(sid)

    def _flush(self, sid: int) -> None:
        stream = self._streams.get(sid)
        if stream is None or self.ended is not None:
            return
        try:
            while stream.outbound:
                window = min(self._h2.local_flow_control_window(sid),
                             self._h2.max_outbound_frame_size)
                if window <= 0:
                    return
                chunk = bytes(stream.outbound[:window])
                del stream.outbound[:window]
                last = not stream.outbound and stream.closing == []
                self._h2.send_data(sid, chunk, end_stream=last)
                if last:
                    self._finish(sid)
                    return
            if stream.closing == []:
                self._h2.send_data(sid, b"", end_stream=True)
                self._finish(sid)
            elif stream.closing is not None:
                self._h2.send_headers(sid, stream.closing, end_stream=True)
                self._finish(sid)
        except (h2.exceptions.ProtocolError, KeyError):
            self._streams.pop(sid, None)

    def _finish(self, sid: int) -> None:
        """Our side of the stream has ended; the peer's may not have (an early answer)."""
        stream = self._streams.pop(sid, None)
        h2_stream = self._h2.streams.get(sid)
        if stream is not None and h2_stream is not None and not h2_stream.closed:
            self._reset(sid, ErrorCodes.NO_ERROR)
