"""Node connections over real sockets: feosd's NodeConnections on a trio run of its own (the
link's thread) dial the control plane's TLS listener on loopback (trustme's certificates, ALPN
feos-node/1), and the control plane (tests/fleet_push.py) pushes calls to the real volume
service and pod events served on this test's run (feosd's runtime).

Shown: pushed volume calls; 1,000 concurrent streams; a reset stream dropping its call's wait
and a reset events stream letting go of its watcher; our ping unanswered closing the connection,
which is dialed again; the stop with calls in flight (those that end in the grace answered,
the rest UNAVAILABLE, a stream's after what it sent); garbage, an oversized frame, a header
block that does not decode, and too many streams each ending their stream or their connection
while the other connection goes on; a peer that does not select ALPN feos-node/1, or that
`verify` refuses, gets no HTTP/2 byte.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, HeadersFrame

sys.path.insert(0, str(Path(__file__).parent.parent))
from fleet_push import LinkThread, PushListener

from feos import _schema
from feos.errors import Code
from feos.fleet._calls import Dispatcher
from feos.fleet._nghttp2 import NgServerCore, server_core
from feos.fleet._nodeconn import NodeConnections, Target, stop_message
from feos.pods import VolumeService
from feos.pods._events import EventHub
from feos.rpc import Cap, capnp_thread

VOLUME = "0b9bb4c4-5d43-4c2b-9d3a-6f2d3c4e5f60"


class Pods:
    """PodService's watchEvents over the real EventHub, and a getPod that waits until its pod
    is released."""

    def __init__(self) -> None:
        self.events = EventHub()
        self.releases: dict[str, trio.Event] = {}
        self.all_released = False
        self.cancelled = 0
        self.waiting = 0

    def release(self, pod_id: str | None = None) -> None:
        if pod_id is None:
            self.all_released = True
            for event in self.releases.values():
                event.set()
        else:
            self.releases.setdefault(pod_id, trio.Event()).set()

    async def watch_events(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"stream": Cap(_schema.pod().EventStream, self.events.watch(params["podId"]))}

    async def get_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        released = self.releases.setdefault(params["id"], trio.Event())
        if self.all_released:
            released.set()
        self.waiting += 1
        try:
            await released.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1
        return {"pod": {"id": params["id"], "state": "running"}}


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    """A bounded poll of what happens on the link's thread."""
    with trio.fail_after(within):
        while not cond():  # noqa: ASYNC110 (a condition without an event)
            await trio.sleep(0.01)


@asynccontextmanager
async def node(tmp_path: Path, listeners: list[PushListener], **kwargs: Any
               ) -> AsyncIterator[tuple[LinkThread, VolumeService, Pods]]:
    volumes = VolumeService(tmp_path)
    volumes.load()
    pods = Pods()
    try:
        async with capnp_thread() as bridge, LinkThread(NodeConnections(Dispatcher(
                {"volumes": volumes, "pods": pods, "mesh": object()},
                trio.lowlevel.current_trio_token(), bridge=bridge), **kwargs)) as link:
            conns = link.conns
            await link.on_link_sync(conns.set_ssl_context, listeners[0].ssl_context_for_node())
            await link.on_link_sync(conns.set_targets, [
                Target("127.0.0.1", lst.port, lst.server_name) for lst in listeners])
            yield link, volumes, pods
            pods.release()
    finally:
        volumes.close()


@asynccontextmanager
async def control_plane(count: int = 1) -> AsyncIterator[list[PushListener]]:
    ca = trustme.CA()
    listeners = [PushListener(ca) for _ in range(count)]
    async with trio.open_nursery() as nursery:
        for lst in listeners:
            await nursery.start(lst.serve)
        yield listeners
        nursery.cancel_scope.cancel()


async def test_pushed_volume_calls_and_the_connection_s_info(tmp_path: Path) -> None:
    async with control_plane() as (cp,), node(tmp_path, [cp]) as (link, _volumes, _pods):
        client = await cp.accept()
        created = await client.call_ok("volumes", "createVolume",
                                       {"id": VOLUME, "sizeBytes": 64 << 20})
        assert created["volume"]["state"] == "available"
        got = await client.call_ok("volumes", "getVolume", {"id": VOLUME})
        assert got["volume"]["sizeBytes"] == 64 << 20
        listed = await client.call_ok("volumes", "listVolumes", {})
        assert [v["id"] for v in listed["volumes"]] == [VOLUME]
        await client.call_ok("volumes", "deleteVolume", {"id": VOLUME})
        missing = await client.call("volumes", "getVolume", {"id": VOLUME})
        assert missing["status"] == {"code": "notFound",
                                     "message": f"volume {VOLUME} does not exist"}
        mesh = await client.call("mesh", "putMeshPeers", {})
        assert mesh["status"] == {"code": "unimplemented",
                                  "message": "putMeshPeers is not built yet"}
        unknown = await client.raw("/volumes/formatDisk", b"")
        assert (unknown.headers[b":status"], unknown.status[0]) == (b"404", Code.UNIMPLEMENTED)
        bad = await client.raw("/volumes/getVolume", b"not capnp")
        assert bad.status[0] == Code.INVALID_ARGUMENT
        [row] = await link.on_link_sync(link.conns.info)
        assert row["target"] == f"127.0.0.1:{cp.port}"
        assert row["state"] == "connected"
        assert row["connectedSince"] is not None


async def test_a_thousand_concurrent_streams(tmp_path: Path) -> None:
    async with control_plane() as (cp,), node(tmp_path, [cp]) as (_link, _volumes, pods):
        client = await cp.accept()
        await client.call_ok("volumes", "createVolume", {"id": VOLUME, "sizeBytes": 64 << 20})
        answers: list[dict[str, Any]] = []

        async def one(i: int) -> None:
            if i % 2:
                answers.append(await client.call("volumes", "getVolume", {"id": VOLUME}))
            else:
                answers.append(await client.call("pods", "getPod", {"id": f"p{i}"}))

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
            await until(lambda: pods.waiting == 500)  # 500 calls held open on feosd's runtime
            pods.release()
        assert len(answers) == 1000
        assert all(a["status"]["code"] == "ok" for a in answers)


async def test_a_reset_stream_drops_its_call_and_lets_go_of_its_watcher(tmp_path: Path) -> None:
    async with control_plane() as (cp,), node(tmp_path, [cp]) as (_link, _volumes, pods):
        client = await cp.accept()
        sid, _pending = await client.request("/pods/getPod", _body("pods", "getPod", id="p"))
        await until(lambda: pods.waiting == 1)
        client.reset(sid)
        await until(lambda: pods.cancelled == 1)
        async with client.stream_call("pods", "watchEvents", {"podId": ""}) as stream:
            first = await stream.first()
            assert first["status"]["code"] == "ok"
            await until(lambda: bool(pods.events.watchers))
            pods.events.publish("a", "running")
            item = await stream.item()
            assert item is not None
            assert [e["podId"] for e in item["events"]] == ["a"]
            stream.reset()
        await until(lambda: not pods.events.watchers)
        assert (await client.call_ok("volumes", "listVolumes", {}))["status"]["code"] == "ok"


async def test_an_unanswered_ping_closes_the_connection_which_is_dialed_again(
        tmp_path: Path) -> None:
    async with control_plane() as (cp,), \
            node(tmp_path, [cp], ping_interval=0.3, ping_timeout=0.6) as (link, _v, _p):
        client = await cp.accept()
        client.answer_pings = False
        with trio.fail_after(10):
            await client.closed.wait()
        assert client.goaway is not None
        assert b"ping" in (client.goaway.additional_data or b"")
        again = await cp.accept()  # after 1 s
        assert (await again.call_ok("volumes", "listVolumes", {}))["status"]["code"] == "ok"
        assert cp.accepted == 2
        [row] = await link.on_link_sync(link.conns.info)
        assert row["state"] == "connected"
        assert "ping was not answered" in row["lastError"]


async def test_the_stop_with_calls_in_flight(tmp_path: Path) -> None:
    async with control_plane() as (cp,), node(tmp_path, [cp]) as (link, _volumes, pods):
        client = await cp.accept()
        quick_sid, quick = await client.request("/pods/getPod", _body("pods", "getPod", id="q"))
        slow_sid, slow = await client.request("/volumes/createVolume", _body(
            "volumes", "createVolume", id=VOLUME, sizeBytes=64 << 20))
        await client.finish(slow_sid, slow)  # a call that ended before the stop
        hung_sid, hung = await client.request("/pods/getPod", _body("pods", "getPod", id="h"))
        async with client.stream_call("pods", "watchEvents", {"podId": ""}) as stream:
            await stream.first()
            await until(lambda: pods.waiting == 2 and bool(pods.events.watchers))
            pods.events.publish("a", "running")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.stop, 1.0)
                await until(lambda: client.goaway is not None)
                assert client.goaway.error_code == ErrorCodes.NO_ERROR
                pods.release("q")  # ends within the grace: its own answer
            item = await stream.item()
            assert item is not None
            assert [e["podId"] for e in item["events"]] == ["a"]
            await stream.pending.done.wait()
            assert stream.status == (Code.UNAVAILABLE, stop_message(1.0))
        answered = await client.finish(quick_sid, quick)
        assert answered.status == (Code.OK, "")
        cut = await client.finish(hung_sid, hung)
        assert cut.status == (Code.UNAVAILABLE, stop_message(1.0))
        assert cut.body == b""  # a call not answered yet gets the status as its answer
        assert pods.cancelled == 1  # and is dropped where it ran
        with trio.fail_after(6):
            await client.closed.wait()
        await trio.sleep(1.5)
        assert cp.accepted == 1  # the dialers dial no more


async def test_bad_input_ends_its_stream_or_its_connection_and_the_other_goes_on(
        tmp_path: Path) -> None:
    async with control_plane(2) as (cp, other), \
            node(tmp_path, [cp, other]) as (_link, _volumes, pods):
        bystander = await other.accept()
        cases = [
            (HeadersFrame(99, b"\xff\xff\xff\xff\xff", flags=["END_HEADERS"]).serialize(),
             ErrorCodes.COMPRESSION_ERROR),
            (DataFrame(1, b"x" * 20000).serialize(), ErrorCodes.FRAME_SIZE_ERROR),
            (b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00", ErrorCodes.PROTOCOL_ERROR),
        ]
        for garbage, code in cases:
            client = await cp.accept()
            await client.call_ok("volumes", "listVolumes", {})
            client.send_raw(bytes(garbage))
            with trio.fail_after(10):
                await client.closed.wait()
            assert client.goaway is not None
            assert client.goaway.error_code == code
            assert (await bystander.call_ok("volumes", "listVolumes", {}))["status"]
        client = await cp.accept()
        client.ignore_limit = True
        opened = [await client.request("/pods/getPod", _body("pods", "getPod", id=f"p{i}"))
                  for i in range(1030)]
        if isinstance(server_core(), NgServerCore):
            # libnghttp2: past the limit the peer acknowledged, the connection's error
            await until(lambda: client.goaway is not None)
            assert client.goaway is not None
            assert client.goaway.error_code == ErrorCodes.PROTOCOL_ERROR
            assert b"max concurrent streams" in client.goaway.additional_data
            await until(lambda: pods.waiting == 0)  # the calls taken were dropped with it
            assert (await bystander.call_ok("volumes", "listVolumes", {}))["status"]
            return
        await until(lambda: sum(p.response.reset is not None for _s, p in opened) == 6)
        refused = [p.response.reset for _s, p in opened if p.response.reset is not None]
        assert refused == [ErrorCodes.REFUSED_STREAM] * 6
        await until(lambda: pods.waiting == 1024)
        pods.release()
        done = [await client.finish(s, p) for s, p in opened]
        assert sum(r.status[0] == Code.OK for r in done) == 1024
        assert (await client.call_ok("volumes", "listVolumes", {}))["status"]["code"] == "ok"


async def test_a_peer_refused_by_verify_or_without_alpn_gets_no_http2(tmp_path: Path) -> None:
    checked: list[bytes] = []

    def verify(ssl_object: Any) -> None:
        checked.append(ssl_object.getpeercert(binary_form=True))
        raise ValueError("not the control plane's SPIFFE ID")

    async with control_plane() as (cp,), node(tmp_path, [cp]) as (link, _volumes, _pods):
        first = await cp.accept()
        await link.on_link_sync(link.conns.set_ssl_context, cp.ssl_context_for_node(), verify)
        # a new context: the old connection is shut (GOAWAY) and the next dial is checked
        await until(lambda: first.goaway is not None)
        refused = await cp.accept()
        with trio.fail_after(10):
            await refused.closed.wait()
        assert refused.received == 0  # not one HTTP/2 byte
        assert checked  # verify saw the peer's certificate
        await until(lambda: "SPIFFE" in link.conns.info()[0]["lastError"])
    async with control_plane() as (cp,):
        cp.server_ctx.set_alpn_protocols(["h2"])
        async with node(tmp_path, [cp]) as (link, _volumes, _pods):
            await until(lambda: "ALPN" in link.conns.info()[0]["lastError"])
            # the listener's side of the handshake may end after the node has refused
            await until(lambda: cp.accepted >= 1)


def _body(service: str, method: str, **params: Any) -> bytes:
    from fleet_push import params_body

    return params_body(service, method, params)


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Any:
    before = {t.name for t in threading.enumerate()}
    yield
    assert not [t for t in threading.enumerate() if t.name == "link" and "link" not in before]


async def test_a_target_no_longer_listed_is_shut_and_not_dialed_again(tmp_path: Path) -> None:
    async with control_plane(2) as (cp, other), \
            node(tmp_path, [cp, other]) as (link, _volumes, _pods):
        client = await cp.accept()
        kept = await other.accept()
        await link.on_link_sync(link.conns.set_targets,
                                [Target("127.0.0.1", other.port, other.server_name)])
        await until(lambda: client.goaway is not None)
        assert client.goaway is not None
        assert client.goaway.error_code == ErrorCodes.NO_ERROR
        with trio.fail_after(10):
            await client.closed.wait()  # its calls done (none), it closes
        rows = link.conns.info()  # info() may be read from any thread
        assert [r["target"] for r in rows] == [f"127.0.0.1:{other.port}"]
        await trio.sleep(1.5)
        assert cp.accepted == 1
        assert (await kept.call_ok("volumes", "listVolumes", {}))["status"]["code"] == "ok"


async def test_pings_go_at_their_interval_once_answered(tmp_path: Path) -> None:
    """An answered ping arms the next one at ping_interval, not at the unanswered one's timeout."""
    async with control_plane() as (cp,), \
            node(tmp_path, [cp], ping_interval=0.2, ping_timeout=30) as (_link, _v, _p):
        client = await cp.accept()
        await until(lambda: client.pings_seen >= 5, within=10)
