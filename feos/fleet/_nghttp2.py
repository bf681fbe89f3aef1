"""A node connection's HTTP/2 over libnghttp2 (feos._nghttp2, cffi's API mode): `NgServerCore`,
the same sans-IO core as feos.fleet._h2server's `ServerCore` (over h2), event for event.

Why: the h2 core costs 150-214 us of CPU per pushed call, libnghttp2 14-19 us
(bench/fleet_nghttp2.py); style rule 14's differential test is tests/unit/test_fleet_ngcore.py
(both cores driven by the same client's random calls, resets, windows and pings, their events
and answers compared). `server_core()` picks the core: FEOS_FLEET_HTTP2=h2 or nghttp2 (the
default); where feos._nghttp2 is not built (no libnghttp2-dev at the build) it is h2's.

Theory of operation: libnghttp2 keeps the connection's state (frames, HPACK, flow control,
stream states, the SETTINGS and PING acknowledgements); native/build.py's C glue hands Python
only what the core acts on: a request's HEADERS (in one call with its :path and whether its
:method is POST), its DATA, its end, the peer's RST_STREAM, our PING's ACK, the peer's GOAWAY,
a stream's close, a GOAWAY that went out. The events, the answers and `data_to_send` are as in
ServerCore's theory of operation; an answer's body waits in the core (`buffered`) and
libnghttp2 pulls it as the windows allow (`_on_read`); an answer that ended before the request
did is followed by RST_STREAM NO_ERROR (the C glue).

Errors: a connection error libnghttp2 finds in the peer's bytes (a frame that does not parse
or is over MAX_FRAME_SIZE, a header block that does not decode, DATA on a closed stream, a bad
SETTINGS) is answered by its GOAWAY with the error's code and libnghttp2's message as the debug
data, and ends the connection (`ConnectionEnded(code, "protocol error: <message>", by_peer)`);
what libnghttp2 cannot go on from (a preface that is not HTTP/2's, control frames flooded faster
than read, a header list over MAX_HEADER_LIST, a failure of ours in a callback) gets a GOAWAY
written here (PROTOCOL_ERROR, ENHANCE_YOUR_CALM, ENHANCE_YOUR_CALM, INTERNAL_ERROR) and nothing
after it. A stream error (a request libnghttp2's HTTP checks refuse) resets that stream only.
Nothing the peer sends raises out of the core.

Where it differs from ServerCore (the differential test pins each): a stream over
MAX_CONCURRENT_STREAMS is refused (REFUSED_STREAM) until the peer acknowledged our SETTINGS, and
ends the connection (PROTOCOL_ERROR) after, as libnghttp2 does (RFC 9113 5.1.2 allows either);
a request that breaks HTTP's rules (a missing pseudo-header, an uppercase name) ends its stream,
not the connection. A stream the peer opens after our drain's GOAWAY, which libnghttp2 would
ignore without a word, is refused (REFUSED_STREAM) as h2's core refuses it: the C glue sees its
HEADERS begin and the core resets it once libnghttp2 has taken its id (`_late`).
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

from h2.errors import ErrorCodes

from ..errors import Code
from . import _h2server
from ._h2server import (
    CONNECTION_WINDOW,
    EOF_REASON,
    ITEM_PREFIX,
    MAX_BODY,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST,
    MAX_STREAMS,
    STREAM_HEADERS,
    STREAM_WINDOW,
    CallStarted,
    ConnectionEnded,
    CoreBase,
    Event,
    StreamGone,
    answer_headers,
)

try:
    from feos import _nghttp2  # type: ignore[attr-defined]
except ImportError as exc:  # not built: native/build.py found no libnghttp2-dev
    _nghttp2, MISSING = None, str(exc)
else:
    MISSING = ""

log = logging.getLogger(__name__)

_GOAWAY = struct.Struct(">BHBBIII")  # the frame's header (a 24-bit length), last id, code
NVA_CACHE = 256  # header arrays kept per connection (answers differ by status and message)


# what a connection error's code says of the peer's frame, beside libnghttp2's message
_WHAT = {
    ErrorCodes.PROTOCOL_ERROR: "a frame that breaks HTTP/2's rules",
    ErrorCodes.FRAME_SIZE_ERROR: f"a frame over {MAX_FRAME_SIZE} bytes or of a size its type "
                                 "does not allow",
    ErrorCodes.COMPRESSION_ERROR: "a header block that does not decode (HPACK)",
    ErrorCodes.FLOW_CONTROL_ERROR: "DATA past the window we gave, or a window past 2^31-1",
    ErrorCodes.STREAM_CLOSED: "a frame on a stream that had closed",
    ErrorCodes.SETTINGS_TIMEOUT: "our SETTINGS not acknowledged in time",
}


def available() -> bool:
    return _nghttp2 is not None


def server_core(**kwargs: Any) -> NgServerCore | _h2server.ServerCore:
    """The node connection's HTTP/2 core: FEOS_FLEET_HTTP2 names it (nghttp2, the default, or
    h2); nghttp2's where feos._nghttp2 is built."""
    which = os.environ.get("FEOS_FLEET_HTTP2", "nghttp2")
    if which not in ("nghttp2", "h2"):
        raise ValueError(f"FEOS_FLEET_HTTP2 is {which!r}: it is nghttp2 or h2")
    if which == "nghttp2" and _nghttp2 is not None:
        return NgServerCore(**kwargs)
    if which == "nghttp2":
        log.warning("feos._nghttp2 is not built (%s): node connections run over h2", MISSING)
    return _h2server.ServerCore(**kwargs)


def goaway_frame(last_stream_id: int, code: int, data: bytes) -> bytes:
    length = 8 + len(data)
    return _GOAWAY.pack(length >> 16, length & 0xFFFF, 0x7, 0, 0, last_stream_id, code) + data


def build_nva(ffi: Any, headers: list[tuple[bytes, bytes]]) -> tuple[Any, list[Any]]:
    """Headers as libnghttp2's name-value array, and the buffers it points into (the caller
    keeps them alive until libnghttp2 has copied the headers)."""
    nva = ffi.new("nghttp2_nv[]", len(headers))
    keep: list[Any] = []
    for i, (name, value) in enumerate(headers):
        n, v = ffi.from_buffer(name), ffi.from_buffer(value)
        keep += (n, v)
        entry = nva[i]
        entry.name, entry.value = ffi.cast("uint8_t *", n), ffi.cast("uint8_t *", v)
        entry.namelen, entry.valuelen = len(name), len(value)
    return nva, keep


@functools.lru_cache(maxsize=NVA_CACHE)
def _answer_headers(code: Code, message: str, http_status: int) -> list[tuple[bytes, bytes]]:
    """answer_headers, made once per kind of answer (its percent-encoding is a call's cost)."""
    return answer_headers(code, message, http_status)


def _code(value: int) -> ErrorCodes | int:
    try:
        return ErrorCodes(value)
    except ValueError:
        return value


class _Stream:
    __slots__ = (
        "body",
        "closing",
        "deferred",
        "outbound",
        "path",
        "started",
        "submitted",
    )

    def __init__(self, path: bytes) -> None:
        self.path = path
        self.body = bytearray()
        self.started = False  # CallStarted given: the loop owns it until it answers
        self.submitted = False  # its answer's HEADERS handed to libnghttp2
        self.deferred = False  # libnghttp2 waits for its next bytes (resume_data)
        self.outbound = bytearray()
        # once outbound is out: trailers to send, or [] to end with the last DATA
        self.closing: list[tuple[bytes, bytes]] | None = None


class NgServerCore(CoreBase):
    """One node connection's HTTP/2 server side over libnghttp2; see the module's docstring
    and ServerCore's theory of operation."""

    def __init__(self, *, max_streams: int = MAX_STREAMS, max_body: int = MAX_BODY,
                 ping_interval: float = 10.0, ping_timeout: float = 20.0) -> None:
        if _nghttp2 is None:
            raise ImportError(f"feos._nghttp2 is not built ({MISSING}): install libnghttp2-dev "
                              "and run native/build.py")
        self._ffi, self._lib = _nghttp2.ffi, _nghttp2.lib
        self._ng = self._ffi.new("struct feos_ng *")
        self._handle = self._ffi.new_handle(self)
        rv = self._lib.feos_ng_new(self._ng, self._handle, MAX_HEADER_LIST, 0)
        if rv != 0:
            raise MemoryError(f"nghttp2_session_server_new: {self._error_name(rv)}")
        weakref.finalize(self, self._lib.feos_ng_del, self._ng)
        self._session = self._ng.session
        self._ptr = self._ffi.new("const uint8_t **")
        super().__init__(max_streams, max_body, ping_interval, ping_timeout)
        self._streams: dict[int, _Stream] = {}
        self._nvas: dict[tuple[tuple[bytes, bytes], ...], tuple[Any, list[Any]]] = {}
        self._out = bytearray()
        self._events: list[Event] = []
        self._now = 0.0
        self._closing: tuple[int, bytes] | None = None  # our last GOAWAY: code, debug data
        self._final = False  # nothing goes out any more
        self._error = ""  # libnghttp2's last message about the peer's bytes
        self._late: list[int] = []  # streams opened after the drain's GOAWAY, to refuse
        self._exc: BaseException | None = None  # ours, in a callback

    def _error_name(self, rv: int) -> str:
        return str(self._ffi.string(self._lib.nghttp2_strerror(rv)).decode())

    # -- the connection ------------------------------------------------------------------------

    def start(self, now: float) -> None:
        lib = self._lib
        entries = [(lib.NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams),
                   (lib.NGHTTP2_SETTINGS_MAX_FRAME_SIZE, MAX_FRAME_SIZE),
                   (lib.NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
                   (lib.NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                   (lib.NGHTTP2_SETTINGS_ENABLE_PUSH, 0)]
        settings = self._ffi.new("nghttp2_settings_entry[]", entries)
        self._check(lib.nghttp2_submit_settings(self._session, 0, settings, len(entries)),
                    "nghttp2_submit_settings")
        self._check(lib.nghttp2_session_set_local_window_size(self._session, 0, 0,
                                                              CONNECTION_WINDOW),
                    "nghttp2_session_set_local_window_size")
        self._next_ping = now + self.ping_interval

    def _check(self, rv: int, what: str) -> None:
        if rv != 0:
            raise RuntimeError(f"{what}: {self._error_name(rv)}")

    def data_to_send(self) -> bytes:
        self._pump()
        out, self._out = bytes(self._out), bytearray()
        return out

    def _pump(self) -> None:
        """What libnghttp2 has to send, into _out; up to our last GOAWAY."""
        ffi, lib, session, ptr = self._ffi, self._lib, self._session, self._ptr
        while not self._final:
            n = lib.nghttp2_session_mem_send(session, ptr)
            if n == 0:
                return
            if n < 0:
                self._fatal(ErrorCodes.INTERNAL_ERROR, self._fatal_reason(n), by_peer=False)
                return
            self._out += ffi.buffer(ptr[0], n)

    def _send_drain(self) -> None:
        self._drained_at = self._lib.nghttp2_session_get_last_proc_stream_id(self._session)
        self._ng.drained_at = self._drained_at
        reason = b"the node stops"
        self._lib.nghttp2_submit_goaway(self._session, 0, self._drained_at,
                                        ErrorCodes.NO_ERROR, reason, len(reason))

    def _end(self, code: ErrorCodes | int, reason: str, *, by_peer: bool,
             goaway: bool) -> ConnectionEnded:
        if goaway:
            self._pump()  # what was answered before goes out before the GOAWAY
            data = reason.encode()[:256]
            last = self._lib.nghttp2_session_get_last_proc_stream_id(self._session)
            self._closing = (int(code), data)
            self._lib.nghttp2_submit_goaway(self._session, 0, last, int(code), data, len(data))
        else:
            self._final = True
        return self._ended(code, reason, by_peer)

    def _fatal(self, code: ErrorCodes, reason: str, *, by_peer: bool) -> None:
        """libnghttp2 cannot go on: our own GOAWAY, and nothing after it."""
        if self.ended is None:
            last = self._lib.nghttp2_session_get_last_proc_stream_id(self._session)
            self._out += goaway_frame(last, code, reason.encode()[:256])
            self._events.append(self._ended(code, reason, by_peer))
        self._final = True

    def _fatal_reason(self, rv: int) -> str:
        if self._exc is not None:
            return f"bad input: {self._exc!r}"
        return f"libnghttp2: {self._error_name(rv)}"

    def _send_ping(self, payload: bytes) -> None:
        self._lib.nghttp2_submit_ping(self._session, 0, payload)

    # -- what the peer sends -------------------------------------------------------------------

    def receive(self, data: bytes, now: float) -> list[Event]:
        if self.ended is not None:
            return []
        if not data:
            return [self._end(ErrorCodes.NO_ERROR, EOF_REASON, by_peer=True, goaway=False)]
        self._now = now
        events: list[Event] = []
        self._events = events
        lib = self._lib
        self._pump()  # the answers given since: their streams close before the peer's next
        rv = lib.nghttp2_session_mem_recv(self._session, data, len(data))
        if rv < 0:
            if rv == lib.NGHTTP2_ERR_BAD_CLIENT_MAGIC:
                self._fatal(ErrorCodes.PROTOCOL_ERROR,
                            "protocol error: the connection's preface is not HTTP/2's",
                            by_peer=True)
            elif rv == lib.NGHTTP2_ERR_FLOODED:
                self._fatal(ErrorCodes.ENHANCE_YOUR_CALM, "protocol error: the peer sent "
                            "control frames faster than it read their answers", by_peer=True)
            elif rv == lib.NGHTTP2_ERR_CALLBACK_FAILURE and self._ng.over:
                self._fatal(ErrorCodes.ENHANCE_YOUR_CALM,
                            f"protocol error: a header list over {MAX_HEADER_LIST} bytes",
                            by_peer=True)
            else:
                self._fatal(ErrorCodes.INTERNAL_ERROR, self._fatal_reason(rv), by_peer=True)
        else:
            for sid in self._late:  # libnghttp2 has seen their ids: a RST_STREAM may go
                lib.nghttp2_submit_rst_stream(self._session, 0, sid, ErrorCodes.REFUSED_STREAM)
            self._late.clear()
            self._pump()  # a connection error's GOAWAY shows here (_on_goaway_sent)
        if self.ended is not None and self.ended.by_peer and self.ended.code:
            return [self.ended]  # the peer's protocol error: its batch's calls are not taken
        return events

    def _on_request(self, frame: Any, post: int, path: Any, length: int) -> int:
        """A request's HEADERS, with whether its :method is POST and its :path."""
        if self.ended is not None:
            return 0
        hd = frame.hd
        sid = hd.stream_id
        self._streams[sid] = _Stream(self._ffi.buffer(path, length)[:])
        if not post:
            self.answer(sid, Code.INVALID_ARGUMENT, "a call is a POST", http_status=405)
        if hd.flags & self._lib.NGHTTP2_FLAG_END_STREAM:
            self._on_end(sid)
        return 0

    def _on_frame(self, frame: Any) -> int:
        if self.ended is not None:
            return 0
        lib = self._lib
        hd = frame.hd
        kind, sid = hd.type, hd.stream_id
        if kind == lib.NGHTTP2_HEADERS:  # the peer's trailers
            if hd.flags & lib.NGHTTP2_FLAG_END_STREAM:
                self._on_end(sid)
        elif kind == lib.NGHTTP2_DATA:
            self._on_end(sid)
        elif kind == lib.NGHTTP2_RST_STREAM:
            self._gone(sid, _code(frame.rst_stream.error_code), "the peer reset the stream")
        elif kind == lib.NGHTTP2_PING:
            self._on_ping_ack(bytes(self._ffi.buffer(frame.ping.opaque_data, 8)))
        elif kind == lib.NGHTTP2_GOAWAY:
            goaway = frame.goaway
            reason = self._ffi.buffer(goaway.opaque_data, goaway.opaque_data_len)[:].decode(
                errors="replace") if goaway.opaque_data_len else ""
            code = _code(goaway.error_code)
            self._events.append(self._end(code, f"the peer's GOAWAY: {reason or code!s}",
                                          by_peer=True, goaway=False))
        return 0

    def _on_data(self, sid: int, data: Any, length: int) -> int:
        stream = self._streams.get(sid)
        if stream is None or stream.started or self.ended is not None:
            return 0
        if len(stream.body) + length > self.max_body:
            self.answer(sid, Code.RESOURCE_EXHAUSTED,
                        f"the call's body is over {self.max_body} bytes")
            return 0
        stream.body += self._ffi.buffer(data, length)
        return 0

    def _on_end(self, sid: int) -> None:
        stream = self._streams.get(sid)
        if stream is None or stream.started:
            return
        stream.started = True
        body, stream.body = bytes(stream.body), bytearray()
        self._events.append(CallStarted(sid, stream.path.decode(errors="replace"), body))

    def _on_ping_ack(self, payload: bytes) -> None:
        answered = self._ping_answered(payload, self._now)
        if answered is not None:
            self._events.append(answered)

    def _gone(self, sid: int, code: ErrorCodes | int, reason: str) -> None:
        stream = self._streams.pop(sid, None)
        if stream is not None and stream.started:
            self._events.append(StreamGone(sid, code, reason))

    def _on_close(self, sid: int, code: int) -> int:
        """libnghttp2 closed a stream we still held: reset by it (a stream error of the
        peer's) or by the peer (then _gone has taken it already)."""
        if sid in self._streams and self.ended is None:
            self._gone(sid, _code(code), f"the stream was reset: {_code(code)!s}")
        return 0

    def _on_goaway_sent(self, frame: Any) -> int:
        goaway = frame.goaway
        data = self._ffi.buffer(goaway.opaque_data, goaway.opaque_data_len)[:] \
            if goaway.opaque_data_len else b""
        if self._closing is not None and self._closing == (goaway.error_code, data):
            self._final = True  # our last: nothing after it
        elif goaway.error_code != ErrorCodes.NO_ERROR and self.ended is None:
            # libnghttp2's answer to a connection error of the peer's
            code = _code(goaway.error_code)
            message = data.decode(errors="replace") or self._error
            what = _WHAT.get(code) if isinstance(code, ErrorCodes) else None
            what = what or f"a connection error ({code!s})"
            self._events.append(self._ended(code, f"protocol error: {what}"
                                            + (f" ({message})" if message else ""), True))
            self._final = True
        return 0

    def _on_late(self, sid: int) -> int:
        self._late.append(sid)
        return 0

    def _on_error(self, code: int, message: Any, length: int) -> int:
        self._error = self._ffi.buffer(message, length)[:].decode(errors="replace")
        return 0

    # -- answers -------------------------------------------------------------------------------

    def _nva(self, headers: list[tuple[bytes, bytes]]) -> tuple[Any, list[Any]]:
        """The headers as libnghttp2's array (which it copies when they are submitted): the
        answers' few kinds (status, message) built once each."""
        key = tuple(headers)
        found = self._nvas.get(key)
        if found is None:
            found = build_nva(self._ffi, headers)
            if len(self._nvas) >= NVA_CACHE:
                self._nvas.clear()
            self._nvas[key] = found
        return found

    def _respond(self, sid: int, stream: _Stream, headers: list[tuple[bytes, bytes]],
                 with_body: bool) -> None:
        stream.submitted = True
        nva, _keep = self._nva(headers)  # libnghttp2 copies the headers before it returns
        rv = self._lib.feos_ng_respond(self._ng, sid, nva, len(headers), int(with_body))
        if rv != 0:
            self._streams.pop(sid, None)  # the stream has closed under us
        elif not with_body:
            self._streams.pop(sid, None)

    def answer(self, stream_id: int, code: Code, message: str, body: bytes | None = None, *,
               http_status: int = 200) -> None:
        stream = self._streams.get(stream_id)
        if self.ended is not None or stream is None or stream.submitted:
            return
        headers = _answer_headers(code, message, http_status)
        if body is None:
            self._respond(stream_id, stream, headers, False)
            return
        stream.outbound += body
        stream.closing = []
        self._respond(stream_id, stream, headers, True)

    def open_stream(self, stream_id: int, first: bytes) -> None:
        stream = self._streams.get(stream_id)
        if self.ended is not None or stream is None or stream.submitted:
            return
        stream.outbound += ITEM_PREFIX.pack(len(first)) + first
        self._respond(stream_id, stream, STREAM_HEADERS, True)

    def _send_more(self, sid: int, stream: _Stream) -> None:
        if stream.deferred:
            stream.deferred = False
            self._lib.nghttp2_session_resume_data(self._session, sid)

    def _on_read(self, sid: int, buf: Any, length: int, flags: Any) -> int:
        lib = self._lib
        stream = self._streams.get(sid)
        if stream is None:  # the connection ended: the stream's DATA ends empty
            flags[0] |= lib.NGHTTP2_DATA_FLAG_EOF
            return 0
        out = stream.outbound
        n = min(length, len(out))
        if n:
            self._ffi.memmove(buf, out, n)
            del out[:n]
        if not out:
            if stream.closing == []:
                flags[0] |= lib.NGHTTP2_DATA_FLAG_EOF
                del self._streams[sid]
            elif stream.closing is not None:
                flags[0] |= lib.NGHTTP2_DATA_FLAG_EOF | lib.NGHTTP2_DATA_FLAG_NO_END_STREAM
                nva, _keep = self._nva(stream.closing)
                del self._streams[sid]
                lib.nghttp2_submit_trailer(self._session, sid, nva, len(stream.closing))
            elif not n:
                stream.deferred = True
                return int(lib.NGHTTP2_ERR_DEFERRED)
        return n

    def reset(self, stream_id: int, code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        if self._streams.pop(stream_id, None) is not None and self.ended is None:
            self._lib.nghttp2_submit_rst_stream(self._session, 0, stream_id, int(code))


# -- the C glue's callbacks: each finds its core by the session's handle -----------------------

if _nghttp2 is not None:
    _ffi, _FAIL = _nghttp2.ffi, _nghttp2.lib.NGHTTP2_ERR_CALLBACK_FAILURE

    _F = TypeVar("_F", bound=Callable[..., int])

    def _extern() -> Callable[[_F], _F]:
        """cffi's def_extern, typed: the function is the C glue's callback of its name."""
        return cast(Callable[[_F], _F], _ffi.def_extern())

    def _failed(core: Any, exc: BaseException) -> int:
        core._exc = exc
        return int(_FAIL)

    @_extern()
    def feos_ng_on_request(py: Any, frame: Any, post: int, path: Any, length: int) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_request(frame, post, path, length)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_field(py: Any, sid: int, name: Any, namelen: int, value: Any,
                         valuelen: int) -> int:
        core = _ffi.from_handle(py)  # a client's (tests/fleet_ngclient.py)
        try:
            return int(core._on_field(sid, name, namelen, value, valuelen))
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_frame(py: Any, frame: Any) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_frame(frame)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_data(py: Any, sid: int, data: Any, length: int) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_data(sid, data, length)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_close(py: Any, sid: int, code: int) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_close(sid, code)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_goaway_sent(py: Any, frame: Any) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_goaway_sent(frame)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_error(py: Any, code: int, message: Any, length: int) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_error(code, message, length)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_on_late(py: Any, sid: int) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_late(sid)
        except Exception as exc:
            return _failed(core, exc)

    @_extern()
    def feos_ng_read(py: Any, sid: int, buf: Any, length: int, flags: Any) -> int:
        core: NgServerCore = _ffi.from_handle(py)
        try:
            return core._on_read(sid, buf, length, flags)
        except Exception as exc:
            return _failed(core, exc)
