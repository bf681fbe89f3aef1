"""The node's HTTP/2 for one pushed call: feos.fleet's ServerCore (over h2) beside libnghttp2
through cffi, the gain style rule 14 asks to measure before HTTP/2 in C replaces h2.

No sockets and no TLS: h2's client writes the same calls for both (a HEADERS and a DATA of 80
bytes with END_STREAM each, batches of 300, their bytes made before the clock starts), and each
server answers each call with the four headers of a node connection's answer and 120 bytes of
DATA; the client reads every answer back (outside the clock) and checks it ended whole. What is
timed is the server's side: the bytes in, the events, the answer, the bytes out (CPU time).

The nghttp2 side is a sketch, not a core: the few calls of its API this needs, declared here
(ABI mode: libnghttp2.so.14 is on the machine, its headers are not), a Python callback per
header, chunk, frame and stream close. It answers only what this bench sends.
NgServerCore (feos/fleet/_nghttp2.py, the core the node runs now) is timed beside both.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi
import h2.config
import h2.connection
import h2.events

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feos.errors import Code
from feos.fleet._h2server import CallStarted, ServerCore
from feos.fleet._nghttp2 import NgServerCore

BATCH = 300
BATCHES = 8
REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"node"),
           (b":path", b"/volumes/getVolume"), (b"content-type", b"application/x-capnp")]
ANSWER_HEADERS = [(b":status", b"200"), (b"content-type", b"application/x-capnp"),
                  (b"feos-status", b"0"), (b"feos-message", b"")]
PARAMS, RESULTS = b"p" * 80, b"r" * 120

CDEF = """
typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct { uint8_t *name; uint8_t *value; size_t namelen; size_t valuelen;
                 uint8_t flags; } nghttp2_nv;
typedef struct { size_t length; int32_t stream_id; uint8_t type; uint8_t flags;
                 uint8_t reserved; } nghttp2_frame_hd;
typedef struct { nghttp2_frame_hd hd; } nghttp2_frame;  /* a union: only its header read */
typedef union { int fd; void *ptr; } nghttp2_data_source;
typedef ssize_t (*nghttp2_data_source_read_callback)(nghttp2_session *, int32_t, uint8_t *,
    size_t, uint32_t *, nghttp2_data_source *, void *);
typedef struct { nghttp2_data_source source;
                 nghttp2_data_source_read_callback read_callback; } nghttp2_data_provider;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
int nghttp2_session_callbacks_new(nghttp2_session_callbacks **);
void nghttp2_session_callbacks_set_on_frame_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, void *));
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *));
void nghttp2_session_callbacks_set_on_header_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t,
            const uint8_t *, size_t, uint8_t, void *));
void nghttp2_session_callbacks_set_on_stream_close_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, int32_t, uint32_t, void *));
int nghttp2_session_server_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
void nghttp2_session_del(nghttp2_session *);
int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *, size_t);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const uint8_t **);
int nghttp2_submit_response(nghttp2_session *, int32_t, const nghttp2_nv *, size_t,
                            const nghttp2_data_provider *);
"""
END_STREAM, DATA_EOF = 0x1, 0x1
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 3, 4


class NghttpServer:
    """The bench's calls answered with libnghttp2: `receive(bytes) -> bytes`."""

    def __init__(self, ffi: Any, lib: Any) -> None:
        self.ffi, self.lib = ffi, lib
        self.paths: dict[int, bytes] = {}
        self.bodies: dict[int, bytes] = {}
        self.ended: list[int] = []
        self._keep = [  # the callbacks live as long as the session
            ffi.callback("int(nghttp2_session *, const nghttp2_frame *, const uint8_t *, "
                         "size_t, const uint8_t *, size_t, uint8_t, void *)", self._header),
            ffi.callback("int(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, "
                         "void *)", lambda *_a: 0),
            ffi.callback("int(nghttp2_session *, const nghttp2_frame *, void *)", self._frame),
            ffi.callback("int(nghttp2_session *, int32_t, uint32_t, void *)", self._closed),
        ]
        callbacks = ffi.new("nghttp2_session_callbacks **")
        lib.nghttp2_session_callbacks_new(callbacks)
        lib.nghttp2_session_callbacks_set_on_header_callback(callbacks[0], self._keep[0])
        lib.nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks[0],
                                                                      self._keep[1])
        lib.nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks[0], self._keep[2])
        lib.nghttp2_session_callbacks_set_on_stream_close_callback(callbacks[0], self._keep[3])
        session = ffi.new("nghttp2_session **")
        lib.nghttp2_session_server_new(session, callbacks[0], ffi.NULL)
        self.session = session[0]
        settings = ffi.new("nghttp2_settings_entry[2]",
                           [(MAX_CONCURRENT_STREAMS, 1024), (INITIAL_WINDOW_SIZE, 1 << 20)])
        lib.nghttp2_submit_settings(self.session, 0, settings, 2)
        self._read = ffi.callback("ssize_t(nghttp2_session *, int32_t, uint8_t *, size_t, "
                                  "uint32_t *, nghttp2_data_source *, void *)", self._body)
        self._provider = ffi.new("nghttp2_data_provider *")
        self._provider.read_callback = self._read
        self._names = [ffi.new("uint8_t[]", part) for pair in ANSWER_HEADERS for part in pair]
        self._nv = ffi.new("nghttp2_nv[]", len(ANSWER_HEADERS))
        for i, (name, value) in enumerate(ANSWER_HEADERS):
            entry = self._nv[i]
            entry.name, entry.value = self._names[2 * i], self._names[2 * i + 1]
            entry.namelen, entry.valuelen, entry.flags = len(name), len(value), 0
        self._out = ffi.new("const uint8_t **")

    def _header(self, _s: Any, frame: Any, name: Any, namelen: int, value: Any, valuelen: int,
                _flags: int, _ud: Any) -> int:
        if self.ffi.buffer(name, namelen)[:] == b":path":
            self.paths[frame.hd.stream_id] = self.ffi.buffer(value, valuelen)[:]
        return 0

    def _frame(self, _s: Any, frame: Any, _ud: Any) -> int:
        if frame.hd.flags & END_STREAM and frame.hd.type in (0, 1):  # DATA, HEADERS
            self.ended.append(frame.hd.stream_id)
        return 0

    def _closed(self, _s: Any, sid: int, _code: int, _ud: Any) -> int:
        self.paths.pop(sid, None)
        self.bodies.pop(sid, None)
        return 0

    def _body(self, _s: Any, sid: int, buf: Any, length: int, flags: Any, _src: Any,
              _ud: Any) -> int:
        body = self.bodies[sid]
        size = min(len(body), length)
        self.ffi.memmove(buf, body[:size], size)
        self.bodies[sid] = body[size:]
        if size == len(body):
            flags[0] |= DATA_EOF
        return size

    def receive(self, data: bytes) -> bytes:
        self.lib.nghttp2_session_mem_recv(self.session, data, len(data))
        for sid in self.ended:
            assert self.paths.get(sid) == b"/volumes/getVolume"
            self.bodies[sid] = RESULTS
            self.lib.nghttp2_submit_response(self.session, sid, self._nv, len(ANSWER_HEADERS),
                                             self._provider)
        self.ended.clear()
        parts = []
        while (size := self.lib.nghttp2_session_mem_send(self.session, self._out)) > 0:
            parts.append(self.ffi.buffer(self._out[0], size)[:])
        return b"".join(parts)

    def close(self) -> None:
        self.lib.nghttp2_session_del(self.session)


def h2_server(kind: type = ServerCore) -> Callable[[bytes], bytes]:
    core = kind()
    core.start(0.0)

    def receive(data: bytes) -> bytes:
        for event in core.receive(data, 0.0):
            if isinstance(event, CallStarted):
                core.answer(event.stream_id, Code.OK, "", RESULTS)
        return core.data_to_send()

    return receive


class _Client(h2.connection.H2Connection):
    open_outbound_streams = 0  # every call is answered before the next batch


def cpu_per_call(receive: Callable[[bytes], bytes]) -> float:
    client = _Client(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.receive_data(receive(client.data_to_send()))
    receive(client.data_to_send())
    spent, whole = 0.0, 0
    for _ in range(BATCHES):
        requests = []
        for _ in range(BATCH):
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, REQUEST)
            client.send_data(sid, PARAMS, end_stream=True)
            requests.append(client.data_to_send())
        start = time.process_time()
        answers = [receive(request) for request in requests]
        spent += time.process_time() - start
        for answer in answers:
            for event in client.receive_data(answer):
                if isinstance(event, h2.events.DataReceived):
                    client.acknowledge_received_data(event.flow_controlled_length,
                                                     event.stream_id)
                whole += isinstance(event, h2.events.StreamEnded)
            if update := client.data_to_send():
                receive(update)
    if whole != BATCH * BATCHES:
        raise SystemExit(f"{whole} of {BATCH * BATCHES} answers ended whole")
    return spent / (BATCH * BATCHES)


def main() -> None:
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib = ffi.dlopen("libnghttp2.so.14")
    h2_runs, ng_runs, core_runs = [], [], []
    for _ in range(3):
        h2_runs.append(cpu_per_call(h2_server()))
        server = NghttpServer(ffi, lib)
        ng_runs.append(cpu_per_call(server.receive))
        server.close()
        core_runs.append(cpu_per_call(h2_server(NgServerCore)))
    h2_cost, ng_cost, core_cost = min(h2_runs), min(ng_runs), min(core_runs)
    print(f"the server's CPU per call: h2 ServerCore {h2_cost * 1e6:.1f} us, "
          f"libnghttp2 through cffi {ng_cost * 1e6:.1f} us (the sketch), "
          f"NgServerCore {core_cost * 1e6:.1f} us")
    print(f"ratio nghttp2 / h2 CPU per call: {ng_cost / h2_cost:.2f} (target < 0.5)")
    print(f"ratio NgServerCore / h2 ServerCore CPU per call: {core_cost / h2_cost:.2f} "
          "(target < 0.5)")


if __name__ == "__main__":
    main()
