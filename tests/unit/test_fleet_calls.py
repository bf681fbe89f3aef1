"""The node connections' Dispatcher (feos.fleet._calls) over feosd's real volume service and pod
events: paths, Cap'n Proto bodies, where a call runs, and what a dropped wait does.

The link runs on a trio run of its own in another thread (as in feosd): `link(fn)` runs fn there
while this test's run plays feosd's runtime.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from feos import _schema
from feos.errors import Code, FeosError
from feos.fleet._calls import INTERFACES, Answer, Dispatcher, _struct, decode, reader_dict
from feos.net import NoMesh
from feos.net._mesh import NOT_MESHED
from feos.pods import VolumeService
from feos.pods._events import EventHub
from feos.pods._streams import Relay
from feos.rpc import Cap
from feos.rpc._bridge import capnp_thread

T = TypeVar("T")
VOLUME = "0b9bb4c4-5d43-4c2b-9d3a-6f2d3c4e5f60"


def body(service: str, method: str, **params: Any) -> bytes:
    iface = {"volumes": _schema.volume().VolumeService, "pods": _schema.pod().PodService,
             "mesh": _schema.network().MeshService}[service]
    m = iface.schema.methods[method]
    return bytes(_struct(m.param_type, "p").new_message(**params).to_bytes())


def results(service: str, method: str, answer: Answer) -> dict[str, Any]:
    iface = {"volumes": _schema.volume().VolumeService, "pods": _schema.pod().PodService,
             "mesh": _schema.network().MeshService}[service]
    assert answer.body is not None
    with _struct(iface.schema.methods[method].result_type, "r").from_bytes(answer.body) as r:
        found: dict[str, Any] = r.to_dict()
        return found


async def until(cond: Callable[[], bool], within: float = 5.0) -> None:
    """A bounded poll of what happens on another thread, which no trio event of ours tells."""
    with trio.fail_after(within):
        while not cond():  # noqa: ASYNC110 (a condition without an event)
            await trio.sleep(0.005)


async def link(fn: Callable[[], Awaitable[T]]) -> T:
    """fn() on a trio run of its own in another thread, as the link runs."""
    return await trio.to_thread.run_sync(trio.run, fn)


@pytest.fixture
async def volumes(tmp_path: Path) -> AsyncIterator[VolumeService]:
    service = VolumeService(tmp_path)
    service.load()
    yield service
    service.close()


class Pods:
    """PodService's watchEvents over the real EventHub, and a change that takes its time."""

    def __init__(self) -> None:
        self.events = EventHub()
        self.started = threading.Event()
        self.cancelled = False

    async def watch_events(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"stream": Cap(_schema.pod().EventStream, self.events.watch(params["podId"]))}

    async def get_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


async def test_volume_calls_run_where_the_socket_runs_them_from_the_link_s_thread(
        volumes: VolumeService) -> None:
    """CreateVolume on the Cap'n Proto thread (as on the socket), DeleteVolume on feosd's trio
    runtime, GetVolume at once on the link's thread."""
    async with capnp_thread() as bridge:
        calls = Dispatcher({"volumes": volumes}, trio.lowlevel.current_trio_token(), bridge=bridge)

        async def pushed() -> list[Answer]:
            return [
                await calls.call("/volumes/createVolume",
                                 body("volumes", "createVolume", id=VOLUME, sizeBytes=64 << 20)),
                await calls.call("/volumes/getVolume", body("volumes", "getVolume", id=VOLUME)),
                await calls.call("/volumes/deleteVolume",
                                 body("volumes", "deleteVolume", id=VOLUME)),
                await calls.call("/volumes/getVolume", body("volumes", "getVolume", id=VOLUME)),
            ]

        created, got, deleted, gone = await link(pushed)
    assert created.code == Code.OK
    assert results("volumes", "createVolume", created)["volume"]["sizeBytes"] == 64 << 20
    assert results("volumes", "getVolume", got)["volume"]["id"] == VOLUME
    assert deleted.code == Code.OK
    assert (gone.code, gone.message) == (Code.NOT_FOUND, f"volume {VOLUME} does not exist")
    assert results("volumes", "getVolume", gone)["status"]["code"] == "notFound"


async def test_paths_and_bodies_that_name_no_call(volumes: VolumeService) -> None:
    calls = Dispatcher({"volumes": volumes}, trio.lowlevel.current_trio_token())
    for path in ("/volumes/nope", "/nope/getVolume", "/volumes", "", "/"):
        answer = await calls.call(path, b"")
        assert (answer.code, answer.http_status, answer.body) == (Code.UNIMPLEMENTED, 404, None)
    for bad in (b"garbage!", b"\xff" * 16, b"\0\0\0\0\x10\0\0\0"):
        answer = await calls.call("/volumes/getVolume", bad)
        assert answer.code == Code.INVALID_ARGUMENT
        assert answer.message.startswith("the body is not the method's params")
        assert answer.body is None
    empty = await calls.call("/volumes/listVolumes", b"")  # an empty body: every field unset
    assert (empty.code, results("volumes", "listVolumes", empty).get("volumes", [])) == (Code.OK, [])
    wrong = await calls.call("/volumes/getVolume", body("volumes", "getVolume", id="x"))
    assert wrong.code == Code.INVALID_ARGUMENT  # the service's own check, as on the socket


async def test_a_service_without_the_method_answers_unimplemented_with_a_body() -> None:
    calls = Dispatcher({"mesh": object()}, trio.lowlevel.current_trio_token())
    answer = await calls.call("/mesh/putMeshPeers", body("mesh", "putMeshPeers"))
    assert (answer.code, answer.message) == (Code.UNIMPLEMENTED, "putMeshPeers is not built yet")
    assert results("mesh", "putMeshPeers", answer)["status"]["code"] == "unimplemented"


async def test_mesh_calls_reach_the_mesh_service() -> None:
    """The node connections reach MeshService as the socket does: a node off a mesh says so."""
    calls = Dispatcher({"mesh": NoMesh()}, trio.lowlevel.current_trio_token())
    peer = {"publicKey": b"k" * 32, "endpoint": "192.0.2.2:51820", "prefix": "fd00::/96"}
    for method, params in (("getMesh", {}), ("putMeshPeers", {"version": 1, "peers": [peer]}),
                           ("updateMeshPeers", {"fromVersion": 1, "toVersion": 2})):
        answer = await calls.call(f"/mesh/{method}", body("mesh", method, **params))
        assert (answer.code, answer.message) == (Code.FAILED_PRECONDITION, NOT_MESHED), method


async def test_a_dropped_wait_cancels_the_call_where_it_runs() -> None:
    pods = Pods()
    calls = Dispatcher({"pods": pods}, trio.lowlevel.current_trio_token())

    async def pushed() -> None:
        with trio.move_on_after(0.2):
            await calls.call("/pods/getPod", body("pods", "getPod", id="p"))

    await link(pushed)
    await until(lambda: pods.cancelled)
    assert pods.started.is_set()


async def test_a_stream_hands_out_its_pulls_and_lets_go_at_its_close() -> None:
    pods = Pods()
    calls = Dispatcher({"pods": pods}, trio.lowlevel.current_trio_token())
    pulled: list[bytes | None] = []

    async def pushed() -> Answer:
        answer = await calls.call("/pods/watchEvents", body("pods", "watchEvents", podId="a"))
        assert answer.items is not None
        pulled.append(await answer.items.next())
        answer.items.close()
        return answer

    async def publish() -> None:
        await until(lambda: bool(pods.events.watchers))
        pods.events.publish("b", "running")
        pods.events.publish("a", "running", reason="started")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(publish)
        answer = await link(pushed)
    assert answer.code == Code.OK
    assert "stream" not in results("pods", "watchEvents", answer)  # the stream is the items
    item = pulled[0]
    assert item is not None
    m = _schema.pod().EventStream.schema.methods["next"]
    with _struct(m.result_type, "n").from_bytes(item) as reader:
        events = reader.to_dict()["events"]
    assert [(e["podId"], e["reason"]) for e in events] == [("a", "started")]
    await until(lambda: not pods.events.watchers)  # the close reached feosd's runtime


async def test_feosd_s_runtime_gone_answers_unavailable() -> None:
    token: list[trio.lowlevel.TrioToken] = []

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())

    await link(main)  # a runtime that has ended
    calls = Dispatcher({"pods": Pods()}, token[0])
    answer = await calls.call("/pods/getPod", body("pods", "getPod", id="p"))
    assert (answer.code, answer.message) == (Code.UNAVAILABLE, "feosd stops")


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class Logs:
    """PodService's podLogs: the real relay (feos.pods' Relay) on the Cap'n Proto thread, over
    the guest's two streams (here iterators of chunks)."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        self.relays: list[Relay] = []

    async def pod_logs(self, params: dict[str, Any]) -> dict[str, Any]:
        async def open_relay() -> Relay:
            return Relay(_chunks(b"one\n", b"two\n"), _chunks(b"oops\n"))

        relay = await self.bridge.call(open_relay)
        self.relays.append(relay)
        return {"stream": Cap(_schema.pod().ByteStream, relay)}


async def test_a_byte_stream_is_read_on_the_capnp_thread_to_its_end() -> None:
    async with capnp_thread() as bridge:
        logs = Logs(bridge)
        calls = Dispatcher({"pods": logs}, trio.lowlevel.current_trio_token(), bridge=bridge)
        m = _schema.pod().ByteStream.schema.methods["read"]
        read = _struct(m.result_type, "read")

        async def pushed() -> list[dict[str, Any]]:
            answer = await calls.call("/pods/podLogs",
                                      body("pods", "podLogs", id="p", container="c"))
            assert answer.code == Code.OK
            assert answer.items is not None
            got = []
            while (item := await answer.items.next()) is not None:
                with read.from_bytes(item) as reader:
                    got.append(reader.to_dict())
            answer.items.close()
            return got

        items = await link(pushed)
    stdout = b"".join(i.get("stdout", b"") for i in items)
    stderr = b"".join(i.get("stderr", b"") for i in items)
    assert (stdout, stderr) == (b"one\ntwo\n", b"oops\n")
    assert items[-1]["exited"]
    assert items[-1]["exitCode"] == 0


@given(st.data())
def test_a_body_is_params_or_invalid_argument(data: st.DataObject) -> None:
    """Random bytes, and valid params with bytes flipped, inserted or cut: a dict of the params or
    INVALID_ARGUMENT, nothing else."""
    m = _schema.pod().PodService.schema.methods["createPod"]
    params = _struct(m.param_type, "p")
    valid = bytearray(params.new_message(
        id="a", spec={"containers": [{"name": "c", "image": "i", "command": ["sh"]}]},
        pullToken="t").to_bytes())
    raw = data.draw(st.one_of(st.binary(max_size=300), st.just(bytes(valid))))
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 6))):
        if not mutated:
            break
        at = data.draw(st.integers(0, len(mutated) - 1))
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if kind == "flip":
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            mutated[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del mutated[at:]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        found = decode(params, bytes(mutated))
    except FeosError as exc:
        assert exc.code == Code.INVALID_ARGUMENT
    else:
        assert isinstance(found, dict)


# every params and results struct of the API's calls, and the structs they hold
STRUCTS = [_struct(getattr(m, kind), f"{name}${kind}")
           for interface in INTERFACES.values()
           for name, m in interface().schema.methods.items()
           for kind in ("param_type", "result_type")]
SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "bool": st.booleans(), "int8": st.integers(-128, 127), "int16": st.integers(-2**15, 2**15 - 1),
    "int32": st.integers(-2**31, 2**31 - 1), "int64": st.integers(-2**63, 2**63 - 1),
    "uint8": st.integers(0, 255), "uint16": st.integers(0, 2**16 - 1),
    "uint32": st.integers(0, 2**32 - 1), "uint64": st.integers(0, 2**64 - 1),
    "float32": st.just(1.5), "float64": st.floats(allow_nan=False), "text": st.text(max_size=8),
    "data": st.binary(max_size=8), "enum": st.integers(0, 3),
}


def fill(data: st.DataObject, builder: Any, depth: int = 0) -> None:
    """Some of a builder's fields set, one member of its union among them, nested to depth 3."""
    schema = builder.schema
    names = [n for n in schema.non_union_fields if data.draw(st.booleans())]
    if schema.union_fields:
        names.append(data.draw(st.sampled_from(schema.union_fields)))
    for name in names:
        proto = schema.fields[name].proto
        if proto.which == "group":
            fill(data, builder.init(name), depth + 1)
            continue
        kind = proto.slot.type
        which = kind._which_str()
        if which == "struct" and depth < 3:
            fill(data, builder.init(name), depth + 1)
        elif which == "list" and depth < 3:
            element = kind.list.elementType._which_str()
            size = data.draw(st.integers(0, 2))
            if element == "struct":
                items = builder.init(name, size)
                for i in range(size):
                    fill(data, items[i], depth + 1)
            elif element in SCALARS:
                try:
                    setattr(builder, name, data.draw(st.lists(SCALARS[element], max_size=size)))
                except Exception:  # an enum's value it does not have
                    pass
        elif which in SCALARS:
            try:
                setattr(builder, name, data.draw(SCALARS[which]))
            except Exception:  # an enum's value it does not have
                pass


@given(st.data())
def test_reader_dict_is_pycapnp_s_to_dict(data: st.DataObject) -> None:
    """The node's decode of a message is pycapnp's to_dict of it (the socket's), for every
    struct the calls take or give, set at random (an enum's unnamed value raises in both)."""
    struct = data.draw(st.sampled_from(STRUCTS))
    builder = struct.new_message()
    fill(data, builder)
    with struct.from_bytes(builder.to_bytes()) as reader:
        try:
            expected = reader.to_dict()
        except RuntimeError:  # an enum's value the schema does not name: to_dict's raise
            with pytest.raises(RuntimeError):
                reader_dict(reader)
        else:
            assert reader_dict(reader) == expected
