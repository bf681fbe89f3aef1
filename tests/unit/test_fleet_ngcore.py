"""libnghttp2's core (feos.fleet._nghttp2) beside h2's (feos.fleet._h2server): style rule 14's
differential test.

Hypothesis draws a sequence of a control plane's moves (calls with bodies of any size, in one
DATA or several, ended or not; RST_STREAM; PINGs; a new INITIAL_WINDOW_SIZE; acknowledging the
DATA it read, or not, so that the node's answers wait for the window) and of the loop's
(answers, long-lived streams item by item, trailers, resets, time for our pings, the drain).
Each core has its own h2 client, and both get the same moves; after each, bytes go both ways
until neither has any, and the two sides must agree: the cores' events, and every stream's
answer as the client read it (headers, body, trailers, RST_STREAM code). The frames themselves
may differ (HPACK's choices, DATA's sizes, when a WINDOW_UPDATE goes out). What the cores
differ in by design (feos/fleet/_nghttp2.py's docstring) is tested beside, one test each, and
so is the end of a connection on a malformed frame. h2's client closes its side on a GOAWAY
(the drain's): a script ends there, and what comes after a drain is in test_fleet_h2core.py,
which runs each of its tests against both cores.
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, SettingsFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import Code
from feos.fleet import _nghttp2
from feos.fleet._h2server import (
    CallStarted,
    ConnectionEnded,
    PingAnswered,
    ServerCore,
    StreamGone,
)

pytestmark = pytest.mark.skipif(not _nghttp2.available(),
                                reason=f"feos._nghttp2 is not built: {_nghttp2.MISSING}")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_BODY = 3000


def request(path: bytes, method: bytes = b"POST") -> list[tuple[bytes, bytes]]:
    return [(b":method", method), (b":scheme", b"https"), (b":authority", b"node"),
            (b":path", path), (b"content-type", b"application/x-capnp")]


def normal(event: Any) -> tuple[Any, ...]:
    if isinstance(event, CallStarted):
        return ("call", event.stream_id, event.path, event.body)
    if isinstance(event, StreamGone):
        return ("gone", event.stream_id, int(event.code))
    if isinstance(event, PingAnswered):
        return ("pong", event.rtt)
    assert isinstance(event, ConnectionEnded)
    assert event.reason
    return ("ended", int(event.code), event.by_peer)


class Side:
    """One core and the h2 client that talks to it."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.now = 0.0
        core.start(self.now)
        self.cli = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.cli.initiate_connection()
        self.events: list[tuple[Any, ...]] = []
        self.answers: dict[int, dict[str, Any]] = {}
        self.unacked: list[tuple[int, int]] = []
        self.auto_ack = True
        self.answered: set[int] = set()
        self.exchange()

    def exchange(self) -> None:
        for _ in range(2000):
            out = self.cli.data_to_send()
            if out:
                self.events += [normal(e) for e in self.core.receive(out, self.now)]
            back = self.core.data_to_send()
            if back:
                try:
                    for event in self.cli.receive_data(back):
                        self._on(event)
                except h2.exceptions.ProtocolError as exc:
                    self.events.append(("client error", type(exc).__name__))
                    return
            if not out and not back:
                return
        raise AssertionError("the exchange did not settle")

    def _answer(self, sid: int) -> dict[str, Any]:
        return self.answers.setdefault(sid, {"headers": None, "body": b"", "trailers": None,
                                             "reset": None, "ended": False})

    def _on(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self._answer(event.stream_id)["headers"] = dict(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            self._answer(event.stream_id)["body"] += event.data
            self.unacked.append((event.flow_controlled_length, event.stream_id))
            if self.auto_ack:
                self.ack()
        elif isinstance(event, h2.events.TrailersReceived):
            self._answer(event.stream_id)["trailers"] = dict(event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            self._answer(event.stream_id)["ended"] = True
        elif isinstance(event, h2.events.StreamReset):
            self._answer(event.stream_id)["reset"] = int(event.error_code)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.events.append(("goaway", int(event.error_code), event.last_stream_id))

    def ack(self) -> None:
        for length, sid in self.unacked:
            try:
                self.cli.acknowledge_received_data(length, sid)
            except (h2.exceptions.StreamClosedError, KeyError):
                pass
        self.unacked.clear()

    def client(self, what: Any) -> str:
        """A client's move; what h2's client said of it (the same for both, or they differ)."""
        try:
            what(self.cli)
        except h2.exceptions.ProtocolError as exc:
            return type(exc).__name__
        return ""


def call_move(sid: int, method: bytes, body: bytes, chunks: int, end: bool) -> Any:
    def move(cli: h2.connection.H2Connection) -> None:
        path = b"/volumes/getVolume"
        cli.send_headers(sid, request(path, method), end_stream=not body and end)
        if body:
            size = -(-len(body) // chunks)
            for at in range(0, len(body), size):
                cli.send_data(sid, body[at:at + size],
                              end_stream=end and at + size >= len(body))
    return move


moves = st.lists(st.one_of(
    st.tuples(st.just("call"), st.booleans(), st.integers(0, 4000), st.integers(1, 3),
              st.booleans()),
    st.tuples(st.just("data"), st.integers(0, 9), st.integers(0, 300), st.booleans()),
    st.tuples(st.just("client reset"), st.integers(0, 9)),
    st.tuples(st.just("ping")),
    st.tuples(st.just("window"), st.sampled_from([0, 100, 4096, 65535, 200_000])),
    st.tuples(st.just("acks"), st.booleans()),
    st.tuples(st.just("answer"), st.integers(0, 9), st.integers(-1, 100_000)),
    st.tuples(st.just("stream"), st.integers(0, 9), st.lists(st.integers(0, 40_000),
                                                             max_size=4), st.booleans()),
    st.tuples(st.just("reset"), st.integers(0, 9)),
    st.tuples(st.just("time"), st.floats(0, 25)),
    st.tuples(st.just("drain")),
), max_size=30)


def play(side: Side, move: tuple[Any, ...]) -> str:
    kind = move[0]
    core = side.core
    said = ""
    if kind == "call":
        _, post, size, chunks, end = move
        sid = side.cli.get_next_available_stream_id()
        said = side.client(call_move(sid, b"POST" if post else b"GET",
                                     bytes([sid % 251]) * size, chunks, end))
    elif kind == "data":
        sids = sorted(side.cli.streams)
        if not sids:
            return "none"
        sid = sids[move[1] % len(sids)]
        said = side.client(lambda c: c.send_data(sid, b"d" * move[2], end_stream=move[3]))
    elif kind == "client reset":
        sids = sorted(side.cli.streams)
        if not sids:
            return "none"
        sid = sids[move[1] % len(sids)]
        said = side.client(lambda c: c.reset_stream(sid, ErrorCodes.CANCEL))
    elif kind == "ping":
        said = side.client(lambda c: c.ping(b"12345678"))
    elif kind == "window":
        said = side.client(lambda c: c.update_settings(
            {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: move[1]}))
    elif kind == "acks":
        side.auto_ack = move[1]
        side.ack()
    elif kind in ("answer", "stream", "reset"):
        # the loop answers a call once (an answer, or a stream and its end), as feosd's does
        started = [e[1] for e in side.events if e[0] == "call"
                   and (kind == "reset" or e[1] not in side.answered)]
        if not started:
            return "none"
        sid = started[move[1] % len(started)]
        side.answered.add(sid)
        if kind == "answer":
            size = move[2]
            core.answer(sid, Code.OK if size >= 0 else Code.NOT_FOUND, "é: the answer",
                        None if size < 0 else bytes([size % 256]) * size)
        elif kind == "stream":
            core.open_stream(sid, b"first")
            for size in move[2]:
                core.send_item(sid, b"i" * size)
            if move[3]:
                core.end_stream(sid, Code.CANCELLED, "the end")
            side.exchange()  # what waits for the window, once the bytes went
            return f"buffered {core.buffered(sid) > 0} has {core.has(sid)}"
        else:
            core.reset(sid)
    elif kind == "time":
        side.now += move[1]
        side.events += [normal(e) for e in core.tick(side.now)]
    elif kind == "drain":
        core.drain()
    side.exchange()
    return said


@settings(max_examples=400, deadline=None)
@given(moves)
def test_both_cores_give_the_same_events_and_answers(script: list[tuple[Any, ...]]) -> None:
    h2_side = Side(ServerCore(max_body=MAX_BODY, ping_interval=10.0, ping_timeout=5.0))
    ng_side = Side(_nghttp2.NgServerCore(max_body=MAX_BODY, ping_interval=10.0,
                                         ping_timeout=5.0))
    for move in script:
        said = play(h2_side, move), play(ng_side, move)
        assert said[0] == said[1], move
        assert h2_side.events == ng_side.events, move
        assert h2_side.answers == ng_side.answers, move
        assert h2_side.core.open_streams == ng_side.core.open_streams, move
        assert (h2_side.core.ended is None) == (ng_side.core.ended is None), move
        if any(e[0] in ("goaway", "client error") for e in h2_side.events):
            break  # h2's client closes its side on a GOAWAY: it makes no more moves


# -- where they differ by design, and the malformed frames ------------------------------------


def started(core: Any) -> Any:
    core.start(0.0)
    core.data_to_send()
    return core


def test_nghttp2_ends_the_connection_past_the_acknowledged_stream_limit() -> None:
    core = started(_nghttp2.NgServerCore(max_streams=2))
    encoder = __import__("hpack").Encoder()

    def call(sid: int) -> bytes:
        return bytes(HeadersFrame(sid, encoder.encode(request(b"/volumes/getVolume")),
                                  flags=["END_HEADERS"]).serialize())

    core.receive(PREFACE + SettingsFrame(0).serialize() + call(1) + call(3), 0.0)
    assert core.open_streams == 2
    core.receive(SettingsFrame(0, flags=["ACK"]).serialize(), 0.0)  # our SETTINGS taken
    events = core.receive(call(5), 0.0)
    assert [(type(e), e.code) for e in events] == [(ConnectionEnded, ErrorCodes.PROTOCOL_ERROR)]
    assert "max concurrent streams exceeded" in events[0].reason
    assert b"max concurrent streams" in core.data_to_send()
    assert core.receive(call(7), 0.0) == [] and core.data_to_send() == b""


@pytest.mark.parametrize(("garbage", "code", "named"), [
    (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10, ErrorCodes.PROTOCOL_ERROR, "preface"),
    (PREFACE + SettingsFrame(0).serialize() + DataFrame(1, b"x" * 20000).serialize(),
     ErrorCodes.FRAME_SIZE_ERROR, "a frame over 16384 bytes"),
    (PREFACE + SettingsFrame(0).serialize()
     + HeadersFrame(1, b"\xff\xff\xff\xff\xff", flags=["END_HEADERS"]).serialize(),
     ErrorCodes.COMPRESSION_ERROR, "a header block that does not decode"),
    (PREFACE + SettingsFrame(0).serialize() + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00"
     + b"\x00\x00\x00\x00", ErrorCodes.PROTOCOL_ERROR, "WINDOW_UPDATE"),
    (PREFACE + SettingsFrame(0).serialize() + DataFrame(3, b"x").serialize(),
     ErrorCodes.PROTOCOL_ERROR, "DATA"),
])
def test_a_malformed_frame_ends_the_connection_with_its_error_named(
        garbage: bytes, code: ErrorCodes, named: str) -> None:
    for core in (ServerCore(), _nghttp2.NgServerCore()):
        started(core)
        events = core.receive(garbage, 0.0)
        assert [type(e) for e in events] == [ConnectionEnded], core
        assert events[0].code == code, (core, events[0])
        assert events[0].by_peer
        assert core.ended == events[0]
        if isinstance(core, _nghttp2.NgServerCore):
            assert named.lower() in events[0].reason.lower(), events[0].reason
        out = core.data_to_send()
        goaways = [f for f in _frames(out) if isinstance(f, GoAwayFrame)]
        if isinstance(core, _nghttp2.NgServerCore):
            assert [g.error_code for g in goaways] == [code]
        else:  # h2 sends none on a preface that is not HTTP/2's
            assert [g.error_code for g in goaways] in ([code], [])
        assert core.receive(b"more", 0.0) == [] and core.data_to_send() == b""


def test_a_header_list_over_the_cap_ends_the_connection_calmly() -> None:
    encoder = __import__("hpack").Encoder()
    block = encoder.encode([*request(b"/x"), (b"x-big", b"v" * 17000)])
    for core in (ServerCore(), _nghttp2.NgServerCore()):
        started(core)
        frames = PREFACE + SettingsFrame(0).serialize() + b"".join(
            bytes(f.serialize()) for f in _split_headers(1, block))
        events = core.receive(frames, 0.0)
        assert [(type(e), e.code) for e in events] == [
            (ConnectionEnded, ErrorCodes.ENHANCE_YOUR_CALM)], core


def _split_headers(sid: int, block: bytes) -> list[Any]:
    from hyperframe.frame import ContinuationFrame
    parts = [block[i:i + 16000] for i in range(0, len(block), 16000)]
    out: list[Any] = [HeadersFrame(sid, parts[0])]
    out += [ContinuationFrame(sid, p) for p in parts[1:]]
    out[-1].flags.add("END_HEADERS")
    return out


def _frames(data: bytes) -> list[Any]:
    from hyperframe.frame import Frame
    out, at = [], 0
    while at + 9 <= len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[at:at + 9]))
        frame.parse_body(memoryview(data[at + 9:at + 9 + length]))
        out.append(frame)
        at += 9 + length
    return out


def test_server_core_names_the_core() -> None:
    import os
    old = os.environ.get("FEOS_FLEET_HTTP2")
    try:
        os.environ["FEOS_FLEET_HTTP2"] = "h2"
        assert isinstance(_nghttp2.server_core(), ServerCore)
        os.environ["FEOS_FLEET_HTTP2"] = "nghttp2"
        assert isinstance(_nghttp2.server_core(), _nghttp2.NgServerCore)
        os.environ["FEOS_FLEET_HTTP2"] = "quic"
        with pytest.raises(ValueError, match="FEOS_FLEET_HTTP2 is 'quic'"):
            _nghttp2.server_core()
    finally:
        if old is None:
            os.environ.pop("FEOS_FLEET_HTTP2", None)
        else:
            os.environ["FEOS_FLEET_HTTP2"] = old
