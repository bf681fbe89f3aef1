"""The control plane's HTTP/2 client over libnghttp2 (feos._nghttp2's client side), for
bench/fleet.py: h2's client alone cost ~0.43 ms of CPU per pushed call, more than the call's
target allows, so that the bench measured h2 rather than the node.

`NgClientConnection` offers the part of h2's H2Connection that tests/fleet_push.py's PushClient
uses (the same calls, h2's own event classes out of `receive_data`), so that PushClient runs
over either (`PushClient(..., http2="nghttp2")`); the tests keep h2's client, the independent
peer the node is tested against. libnghttp2 answers pings and SETTINGS and sends the
WINDOW_UPDATEs itself (`acknowledge_received_data` has nothing to do); a stream over the node's
limit waits in libnghttp2 until one ends.
"""

from __future__ import annotations

from typing import Any

import h2.events
import h2.exceptions
from h2.errors import ErrorCodes

from feos.fleet import _nghttp2
from feos.fleet._h2server import MAX_HEADER_LIST


class _RemoteSettings:
    def __init__(self, conn: NgClientConnection) -> None:
        self._conn = conn

    @property
    def max_concurrent_streams(self) -> int:
        lib = self._conn._lib
        return int(lib.nghttp2_session_get_remote_settings(
            self._conn._session, lib.NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS))


class NgClientConnection:
    """H2Connection's client calls PushClient makes, over libnghttp2."""

    max_outbound_frame_size = 16384

    def __init__(self, *, window: int = 4 * 1024 * 1024) -> None:
        nghttp2 = _nghttp2._nghttp2
        if nghttp2 is None:
            raise ImportError(f"feos._nghttp2 is not built ({_nghttp2.MISSING})")
        self._ffi, self._lib = nghttp2.ffi, nghttp2.lib
        self._ng = self._ffi.new("struct feos_ng *")
        self._handle = self._ffi.new_handle(self)
        if self._lib.feos_ng_new(self._ng, self._handle, 1 << 20, 1) != 0:
            raise MemoryError("nghttp2_session_client_new")
        self._session = self._ng.session
        self._ptr = self._ffi.new("const uint8_t **")
        self._window = window
        self._next_id = 1
        self._fields: dict[int, list[tuple[bytes, bytes]]] = {}
        self._nvas: dict[tuple[tuple[bytes, bytes], ...], tuple[Any, list[Any]]] = {}
        self._bodies: dict[int, bytearray] = {}
        self._ending: set[int] = set()  # requests whose body has ended
        self._deferred: set[int] = set()
        self._events: list[Any] = []
        self._exc: BaseException | None = None
        self.remote_settings = _RemoteSettings(self)
        self._ended = False

    def __del__(self) -> None:
        self._lib.feos_ng_del(self._ng)

    # -- h2's calls ------------------------------------------------------------------------------

    def initiate_connection(self) -> None:
        lib = self._lib
        entries = [(lib.NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, self._window),
                   (lib.NGHTTP2_SETTINGS_ENABLE_PUSH, 0),
                   (lib.NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)]
        settings = self._ffi.new("nghttp2_settings_entry[]", entries)
        lib.nghttp2_submit_settings(self._session, 0, settings, len(entries))

    def increment_flow_control_window(self, increment: int) -> None:
        self._lib.nghttp2_session_set_local_window_size(self._session, 0, 0,
                                                        65535 + increment)

    def get_next_available_stream_id(self) -> int:
        return self._next_id

    def send_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]],
                     end_stream: bool = False) -> None:
        if stream_id != self._next_id:
            raise h2.exceptions.ProtocolError(f"stream {stream_id} is not the next one")
        key = tuple(headers)
        found = self._nvas.get(key)  # the bench's calls: a few paths, built once each
        if found is None:
            found = self._nvas[key] = _nghttp2.build_nva(self._ffi, headers)
        nva = found[0]
        if not end_stream:
            self._bodies[stream_id] = bytearray()
        sid = self._lib.feos_ng_request(self._ng, nva, len(headers), int(not end_stream))
        if sid < 0:
            raise h2.exceptions.ProtocolError(self._error_name(sid))
        assert sid == stream_id, (sid, stream_id)
        self._next_id += 2

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        body = self._bodies.get(stream_id)
        if body is None:
            raise h2.exceptions.StreamClosedError(stream_id)
        body += data
        if end_stream:
            self._ending.add(stream_id)
        if stream_id in self._deferred:
            self._deferred.discard(stream_id)
            self._lib.nghttp2_session_resume_data(self._session, stream_id)

    def acknowledge_received_data(self, length: int, stream_id: int) -> None:
        """libnghttp2 sends the WINDOW_UPDATEs itself."""

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        self._bodies.pop(stream_id, None)
        self._lib.nghttp2_submit_rst_stream(self._session, 0, stream_id, int(error_code))

    def close_connection(self, error_code: int = 0) -> None:
        last = self._lib.nghttp2_session_get_last_proc_stream_id(self._session)
        self._lib.nghttp2_submit_goaway(self._session, 0, last, int(error_code),
                                        self._ffi.NULL, 0)

    def data_to_send(self) -> bytes:
        out = bytearray()
        while True:
            n = self._lib.nghttp2_session_mem_send(self._session, self._ptr)
            if n <= 0:
                if n < 0:
                    raise h2.exceptions.ProtocolError(self._error_name(n))
                return bytes(out)
            out += self._ffi.buffer(self._ptr[0], n)

    def receive_data(self, data: bytes) -> list[Any]:
        self._events = events = []
        rv = self._lib.nghttp2_session_mem_recv(self._session, data, len(data))
        if rv < 0:
            raise h2.exceptions.ProtocolError(
                repr(self._exc) if self._exc is not None else self._error_name(rv))
        return events

    def _error_name(self, rv: int) -> str:
        return str(self._ffi.string(self._lib.nghttp2_strerror(rv)).decode())

    # -- the C glue's callbacks ------------------------------------------------------------------

    def _on_field(self, sid: int, name: Any, namelen: int, value: Any, valuelen: int) -> int:
        buffer = self._ffi.buffer
        self._fields.setdefault(sid, []).append((buffer(name, namelen)[:],
                                                 buffer(value, valuelen)[:]))
        return 0

    def _on_frame(self, frame: Any) -> int:
        lib = self._lib
        kind, sid, flags = frame.hd.type, frame.hd.stream_id, frame.hd.flags
        events = self._events
        if kind == lib.NGHTTP2_HEADERS:
            kind_of = (h2.events.ResponseReceived
                       if frame.headers.cat == lib.NGHTTP2_HCAT_RESPONSE
                       else h2.events.TrailersReceived)
            events.append(kind_of(stream_id=sid, headers=self._fields.pop(sid, [])))
        elif kind == lib.NGHTTP2_RST_STREAM:
            events.append(h2.events.StreamReset(
                stream_id=sid, error_code=ErrorCodes(frame.rst_stream.error_code)))
            return 0
        elif kind == lib.NGHTTP2_SETTINGS:
            events.append(h2.events.RemoteSettingsChanged())
            return 0
        elif kind == lib.NGHTTP2_PING:
            if not flags & lib.NGHTTP2_FLAG_ACK:
                events.append(h2.events.PingReceived(
                    ping_data=bytes(self._ffi.buffer(frame.ping.opaque_data, 8))))
            return 0
        if flags & lib.NGHTTP2_FLAG_END_STREAM and kind in (lib.NGHTTP2_HEADERS,
                                                             lib.NGHTTP2_DATA):
            events.append(h2.events.StreamEnded(stream_id=sid))
        return 0

    def _on_data(self, sid: int, data: Any, length: int) -> int:
        self._events.append(h2.events.DataReceived(
            stream_id=sid, data=self._ffi.buffer(data, length)[:],
            flow_controlled_length=length))
        return 0

    def _on_close(self, sid: int, code: int) -> int:
        self._bodies.pop(sid, None)
        self._ending.discard(sid)
        self._deferred.discard(sid)
        return 0

    def _on_goaway_sent(self, frame: Any) -> int:
        return 0

    def _on_error(self, code: int, message: Any, length: int) -> int:
        return 0

    def _on_read(self, sid: int, buf: Any, length: int, flags: Any) -> int:
        lib = self._lib
        body = self._bodies.get(sid)
        if body is None:
            flags[0] |= lib.NGHTTP2_DATA_FLAG_EOF
            return 0
        n = min(length, len(body))
        if n:
            self._ffi.memmove(buf, body, n)
            del body[:n]
        if not body:
            if sid in self._ending:
                flags[0] |= lib.NGHTTP2_DATA_FLAG_EOF
                del self._bodies[sid]
                self._ending.discard(sid)
            elif not n:
                self._deferred.add(sid)
                return int(lib.NGHTTP2_ERR_DEFERRED)
        return n

