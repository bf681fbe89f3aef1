"""The node connection's HTTP/2 cores without sockets: h2's (feos.fleet._h2server) and
libnghttp2's (feos.fleet._nghttp2), each test run against both (`ServerCore` is the one of the
module-scoped `core_kind`).

A peer is written frame by frame (hyperframe and hpack, so it can break the rules h2's own
client keeps), or is h2's client for the well-behaved cases; the core's output is read back as
frames. Hypothesis feeds random bytes, and valid frame sequences mutated and cut anywhere, in
any order with the loop's own calls: the core never raises, and what it ends it ends with the
documented frame.
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code
from feos.fleet import _h2server, _nghttp2
from feos.fleet._h2server import (
    MAX_BODY,
    CallStarted,
    ConnectionEnded,
    PingAnswered,
    ServerCore,
    StreamGone,
)


@pytest.fixture(autouse=True, scope="module", params=["h2", "nghttp2"])
def core_kind(request: pytest.FixtureRequest) -> Any:
    """The core the module's tests build as `ServerCore`."""
    global ServerCore
    if request.param == "nghttp2" and not _nghttp2.available():
        pytest.skip(f"feos._nghttp2 is not built: {_nghttp2.MISSING}")
    ServerCore = (_h2server.ServerCore if request.param == "h2"  # type: ignore[misc]
                  else _nghttp2.NgServerCore)
    yield request.param
    ServerCore = _h2server.ServerCore  # type: ignore[misc]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"node"),
           (b":path", b"/volumes/getVolume")]


def frames(data: bytes) -> list[Frame]:
    out = []
    at = 0
    while at + 9 <= len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[at:at + 9]))
        frame.parse_body(memoryview(data[at + 9:at + 9 + length]))
        out.append(frame)
        at += 9 + length
    return out


class Peer:
    """A control plane written by hand: frames as bytes."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()

    def start(self) -> bytes:
        return PREFACE + SettingsFrame(0).serialize()

    def headers(self, sid: int, headers: list[tuple[bytes, bytes]] = REQUEST, *,
                end: bool = False) -> bytes:
        frame = HeadersFrame(sid, self.encoder.encode(headers),
                             flags=["END_HEADERS", *(["END_STREAM"] if end else [])])
        return bytes(frame.serialize())

    def data(self, sid: int, body: bytes, *, end: bool = True) -> bytes:
        return bytes(DataFrame(sid, body, flags=["END_STREAM"] if end else []).serialize())

    def call(self, sid: int, body: bytes = b"params") -> bytes:
        return self.headers(sid) + self.data(sid, body)


def started(now: float = 0.0, **kwargs: Any) -> tuple[ServerCore, Peer]:
    core = ServerCore(**kwargs)
    core.start(now)
    peer = Peer()
    assert core.receive(peer.start(), now) == []
    core.data_to_send()
    return core, peer


def client() -> tuple[ServerCore, h2.connection.H2Connection]:
    core = ServerCore()
    core.start(0.0)
    cli = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                               header_encoding=None))
    cli.initiate_connection()
    exchange(core, cli)
    return core, cli


def exchange(core: ServerCore, cli: h2.connection.H2Connection) -> list[Any]:
    """Bytes both ways until neither side has any; the core's events and the client's."""
    seen: list[Any] = []
    for _ in range(10):
        out = cli.data_to_send()
        if out:
            seen += core.receive(out, 0.0)
        back = core.data_to_send()
        if back:
            seen += cli.receive_data(back)
        if not out and not back:
            break
    return seen


def of(kind: type, items: list[Any]) -> list[Any]:
    return [i for i in items if isinstance(i, kind)]


def test_a_call_arrives_whole_and_its_answer_carries_the_status_in_its_headers() -> None:
    core, cli = client()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"par", end_stream=False)
    cli.send_data(1, b"ams", end_stream=True)
    calls = of(CallStarted, exchange(core, cli))
    assert calls == [CallStarted(1, "/volumes/getVolume", b"params")]
    core.answer(1, Code.NOT_FOUND, "volume x does not exist: é", b"results")
    seen = exchange(core, cli)
    response = of(h2.events.ResponseReceived, seen)[0]
    headers = dict(response.headers)
    assert headers[b":status"] == b"200"
    assert headers[b"feos-status"] == b"5"
    assert headers[b"feos-message"] == b"volume x does not exist: %C3%A9"
    assert b"".join(e.data for e in of(h2.events.DataReceived, seen)) == b"results"
    assert of(h2.events.StreamEnded, seen)
    assert core.open_streams == 0


def test_a_stream_sends_items_framed_then_its_status_as_trailers() -> None:
    core, cli = client()
    cli.send_headers(1, REQUEST, end_stream=True)
    exchange(core, cli)
    core.open_stream(1, b"first")
    core.send_item(1, b"one")
    core.end_stream(1, Code.UNAVAILABLE, "the node stops")
    seen = exchange(core, cli)
    body = b"".join(e.data for e in of(h2.events.DataReceived, seen))
    assert body == b"\0\0\0\5first\0\0\0\3one"
    trailers = dict(of(h2.events.TrailersReceived, seen)[0].headers)
    assert trailers[b"feos-status"] == b"14"


def test_an_answer_over_the_window_waits_for_window_updates() -> None:
    core, cli = client()
    cli.send_headers(1, REQUEST, end_stream=True)
    exchange(core, cli)
    big = bytes(range(256)) * 1024 * 2  # 512 KiB, over the client's 64 KiB window
    core.answer(1, Code.OK, "", big)
    got = bytearray()
    for _ in range(100):
        seen = exchange(core, cli)
        for event in of(h2.events.DataReceived, seen):
            got += event.data
            cli.acknowledge_received_data(event.flow_controlled_length, 1)
        if of(h2.events.StreamEnded, seen):
            break
    assert bytes(got) == big


def test_a_method_other_than_post_is_answered_405() -> None:
    core, peer = started()
    assert core.receive(peer.headers(1, [(b":method", b"GET"), *REQUEST[1:]], end=True), 0) == []
    headers = frames(core.data_to_send())[0]
    assert isinstance(headers, HeadersFrame)
    assert "END_STREAM" in headers.flags
    decoded = dict(hpack.Decoder().decode(headers.data, raw=True))
    assert decoded[b":status"] == b"405"
    assert decoded[b"feos-status"] == str(int(Code.INVALID_ARGUMENT)).encode()


def test_a_body_over_the_cap_is_answered_and_its_upload_stopped() -> None:
    core, peer = started(max_body=10)
    events = core.receive(peer.headers(1) + peer.data(1, b"x" * 11, end=False), 0)
    assert events == []
    out = frames(core.data_to_send())
    decoded = dict(hpack.Decoder().decode(of(HeadersFrame, out)[0].data, raw=True))
    assert decoded[b"feos-status"] == str(int(Code.RESOURCE_EXHAUSTED)).encode()
    assert [f.error_code for f in of(RstStreamFrame, out)] == [ErrorCodes.NO_ERROR]
    # the rest of its upload is a stream error, not the connection's
    assert core.receive(peer.data(1, b"more"), 0) == []
    assert core.ended is None
    assert MAX_BODY >= 16 * 1024 * 1024


def test_a_stream_over_the_limit_is_refused_and_the_connection_goes_on() -> None:
    core, peer = started(max_streams=2)
    events = core.receive(peer.call(1) + peer.call(3) + peer.call(5) + peer.call(7), 0)
    assert [e.stream_id for e in of(CallStarted, events)] == [1, 3]
    resets = of(RstStreamFrame, frames(core.data_to_send()))
    assert {(f.stream_id, f.error_code) for f in resets} >= {(5, ErrorCodes.REFUSED_STREAM),
                                                            (7, ErrorCodes.REFUSED_STREAM)}
    assert core.ended is None
    core.answer(1, Code.OK, "", b"r")
    # HPACK stayed in step: the next stream's headers decode
    events = core.receive(peer.call(9), 0)
    assert of(CallStarted, events) == [CallStarted(9, "/volumes/getVolume", b"params")]


@pytest.mark.parametrize(("bad", "code"), [
    (HeadersFrame(1, b"\xff\xff\xff\xff\xff", flags=["END_HEADERS"]).serialize(),
     ErrorCodes.COMPRESSION_ERROR),
    (DataFrame(1, b"x" * 20000).serialize(), ErrorCodes.FRAME_SIZE_ERROR),
    (b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00", ErrorCodes.PROTOCOL_ERROR),
    (ContinuationFrame(1, b"", flags=["END_HEADERS"]).serialize(), ErrorCodes.PROTOCOL_ERROR),
])
def test_a_connection_error_ends_the_connection_with_its_goaway(bad: bytes,
                                                                code: ErrorCodes) -> None:
    core, peer = started()
    events = core.receive(peer.call(1) + bytes(bad).replace(b"\x00\x00\x00\x01", b"\x00\x00\x00\x03", 1), 0)
    ended = of(ConnectionEnded, events)
    assert ended
    assert ended[0].code == code
    goaway = of(GoAwayFrame, frames(core.data_to_send()))
    assert [g.error_code for g in goaway] == [code]
    assert core.receive(peer.call(3), 0) == []  # an ended core takes nothing


def test_an_oversized_header_list_ends_the_connection() -> None:
    core, peer = started()
    huge = [*REQUEST, (b"x-big", b"v" * 15000), (b"x-big2", b"v" * 15000)]
    block = peer.encoder.encode(huge)
    data = HeadersFrame(1, block[:16000], flags=[]).serialize()
    data += ContinuationFrame(1, block[16000:], flags=["END_HEADERS"]).serialize()
    events = core.receive(bytes(data), 0)
    assert of(ConnectionEnded, events)[0].code == ErrorCodes.ENHANCE_YOUR_CALM


def test_garbage_instead_of_the_preface_ends_the_connection() -> None:
    core = ServerCore()
    core.start(0.0)
    events = core.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0)
    assert of(ConnectionEnded, events)[0].code == ErrorCodes.PROTOCOL_ERROR


def test_a_peer_reset_of_a_call_in_flight_is_stream_gone() -> None:
    core, peer = started()
    core.receive(peer.call(1), 0)
    events = core.receive(RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(), 0)
    assert events == [StreamGone(1, ErrorCodes.CANCEL, "the peer reset the stream")]
    core.answer(1, Code.OK, "", b"late")  # crossing the reset: a no-op
    assert not of(HeadersFrame, frames(core.data_to_send()))


def test_pings_answered_and_unanswered() -> None:
    core, _ = started(ping_interval=10, ping_timeout=20)
    assert core.deadline() == 10
    assert core.tick(10) == []
    ping = of(PingFrame, frames(core.data_to_send()))[0]
    ack = PingFrame(0, ping.opaque_data, flags=["ACK"]).serialize()
    assert core.receive(ack, 10.5) == [PingAnswered(0.5)]
    assert core.deadline() == 20.5
    core.tick(20.5)
    core.data_to_send()
    assert core.tick(40.0) == []
    ended = core.tick(40.5)
    assert ended == [ConnectionEnded(ErrorCodes.NO_ERROR,
                                     "the ping was not answered within 20s", False)]
    assert of(GoAwayFrame, frames(core.data_to_send()))


def test_a_drain_refuses_new_streams_and_answers_those_in_flight() -> None:
    core, peer = started()
    core.receive(peer.call(1) + peer.call(3), 0)
    core.data_to_send()
    core.drain()
    goaway = of(GoAwayFrame, frames(core.data_to_send()))[0]
    assert (goaway.last_stream_id, goaway.error_code) == (3, ErrorCodes.NO_ERROR)
    assert core.receive(peer.call(5), 0) == []
    resets = of(RstStreamFrame, frames(core.data_to_send()))
    assert [(r.stream_id, r.error_code) for r in resets] == [(5, ErrorCodes.REFUSED_STREAM)]
    core.answer(1, Code.OK, "", b"one")
    core.answer(3, Code.OK, "", b"three")
    sent = frames(core.data_to_send())
    assert {f.stream_id for f in of(DataFrame, sent)} == {1, 3}
    assert core.open_streams == 0
    core.close()
    assert of(GoAwayFrame, frames(core.data_to_send()))


def test_the_peers_goaway_and_eof_end_the_connection() -> None:
    core, _ = started()
    events = core.receive(GoAwayFrame(0, last_stream_id=0, additional_data=b"bye").serialize(), 0)
    assert of(ConnectionEnded, events)[0].by_peer
    core, _ = started()
    assert of(ConnectionEnded, core.receive(b"", 0))[0].reason == "the peer closed the connection"


# -- hypothesis ------------------------------------------------------------------------------

def _valid_sequence(peer: Peer) -> list[bytes]:
    return [
        peer.call(1),
        peer.headers(3) + peer.data(3, b"a", end=False) + peer.data(3, b"b"),
        RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
        PingFrame(0, b"12345678").serialize(),
        WindowUpdateFrame(0, window_increment=1000).serialize(),
        WindowUpdateFrame(3, window_increment=1000).serialize(),
        SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 100}).serialize(),
        peer.headers(5, end=True),
        peer.call(7, b"x" * 300),
        GoAwayFrame(0, last_stream_id=0).serialize(),
    ]


OPS = st.sampled_from(["answer", "stream", "item", "end", "reset", "tick", "drain", "close"])


def _act(core: ServerCore, op: str, sid: int, now: float) -> list[Any]:
    if op == "answer":
        core.answer(sid, Code.OK, "", b"r" * 100)
    elif op == "stream":
        core.open_stream(sid, b"first")
    elif op == "item":
        core.send_item(sid, b"i" * 70000)
    elif op == "end":
        core.end_stream(sid, Code.UNAVAILABLE, "stop")
    elif op == "reset":
        core.reset(sid)
    elif op == "tick":
        return core.tick(now)
    elif op == "drain":
        core.drain()
    else:
        core.close()
    return []


def _check(core: ServerCore, events: list[Any]) -> None:
    for event in events:
        assert isinstance(event, CallStarted | StreamGone | PingAnswered | ConnectionEnded)
    if of(ConnectionEnded, events):
        assert core.ended is not None
    frames(core.data_to_send())  # what the core sends is frames, whole


@given(st.lists(st.binary(max_size=200), max_size=8), st.booleans())
def test_random_bytes_never_raise(chunks: list[bytes], preface: bool) -> None:
    core, _ = started() if preface else (ServerCore(), Peer())
    if not preface:
        core.start(0.0)
    for chunk in chunks:
        _check(core, core.receive(chunk, 1.0))


@given(st.data())
def test_mutated_valid_frames_in_any_order_never_raise(data: st.DataObject) -> None:
    core, peer = started()
    pieces = _valid_sequence(peer)
    order = data.draw(st.permutations(range(len(pieces))))
    stream = bytearray(b"".join(pieces[i] for i in order))
    for _ in range(data.draw(st.integers(0, 4))):
        at = data.draw(st.integers(0, len(stream) - 1))
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if kind == "flip":
            stream[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del stream[at:]
            break
        elif kind == "insert":
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=9))
        else:
            del stream[at:at + data.draw(st.integers(1, 9))]
    now = 0.0
    at = 0
    while at < len(stream):
        size = data.draw(st.integers(1, 64))
        events = core.receive(bytes(stream[at:at + size]), now)
        _check(core, events)
        at += size
        if data.draw(st.booleans()):
            now += data.draw(st.floats(0, 30))
            op = data.draw(OPS)
            sid = data.draw(st.sampled_from([1, 3, 5, 7, 9]))
            _check(core, _act(core, op, sid, now))
