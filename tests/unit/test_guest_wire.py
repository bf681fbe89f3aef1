"""The guest's own Cap'n Proto (feos.guest._wire, _rpc) against pycapnp, the node's.

Messages: what pycapnp builds (one segment, or many with far pointers) reads the same through
_wire, and what _wire builds reads the same through pycapnp, for hypothesis's values of the
guest's structs; random bytes end in a WireError, never a hang. RPC: a pycapnp client calls
servers served by _rpc.Connection over a socketpair (bootstrap, pipelined calls, capabilities in
results and their release, exceptions, unknown methods), and _rpc calls a pycapnp server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import capnp
import pytest
from _aio import idle, until
from _modpath import load
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.guest import _rpc, _wire
from feos.guest._proto import guest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = capnp.load(f"{REPO}/schema/guest.capnp", imports=[f"{REPO}/schema"])
RPC = capnp.load(
    os.path.join(os.path.dirname(capnp.__file__), "rpc.capnp"),
    imports=[os.path.dirname(os.path.dirname(capnp.__file__))],
)


def test_the_layout_is_what_the_schema_compiler_says() -> None:
    module = load("feos_guest_layout_gen", f"{REPO}/packaging/guest/layout.py")
    with open(f"{REPO}/feos/guest/_layout.py") as f:
        assert f.read() == module.render(module.request()), "run packaging/guest/layout.py"


texts = st.text(max_size=40)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
mounts = st.lists(st.fixed_dictionaries({"name": texts, "path": texts, "readOnly": st.booleans()}),
                  max_size=4)  # fmt: skip
configs = st.fixed_dictionaries({
    "name": texts, "image": texts, "command": st.lists(texts, max_size=5),
    "env": st.lists(texts, max_size=5), "volumeMounts": mounts, "pullToken": texts,
    "workingDir": texts,
})  # fmt: skip
states = st.fixed_dictionaries({
    "name": texts, "image": texts, "imageDigest": texts,
    "status": st.sampled_from(["created", "running", "stopped"]), "pid": u32,
    "exitCode": st.integers(-(2**31), 2**31 - 1), "createdNs": i64, "startedNs": i64,
    "finishedNs": i64,
})  # fmt: skip


def _py_dict(reader: Any) -> dict[str, Any]:
    out = reader.to_dict()
    if "status" in out:
        out["status"] = str(out["status"])
    return out  # type: ignore[no-any-return]


def _ours(data: bytes, name: str) -> dict[str, Any]:
    return _wire.Message.from_frame(data).root(_wire.Layout.named(name)).to_dict()


def _defaults(value: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """pycapnp's to_dict leaves out fields at their defaults: ours has them all."""
    return {k: v for k, v in full.items() if k in value or v not in ("", 0, [], False)}


@given(configs)
@settings(max_examples=60, deadline=None)
def test_pycapnp_messages_read_the_same(config: dict[str, Any]) -> None:
    data = PY.ContainerConfig.new_message(**config).to_bytes()
    assert _ours(data, "guest.capnp:ContainerConfig") == config


@given(configs, st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_many_segments_and_far_pointers_read_the_same(config: dict[str, Any], first: int) -> None:
    builder = capnp._MallocMessageBuilder(first)  # a tiny first segment: the rest go far
    root = builder.init_root(PY.ContainerConfig)
    for key, value in config.items():
        if key == "volumeMounts":
            out = root.init("volumeMounts", len(value))
            for i, m in enumerate(value):
                out[i].name, out[i].path, out[i].readOnly = m["name"], m["path"], m["readOnly"]
        else:
            setattr(root, key, value)
    segments = [bytes(s) for s in builder.get_segments_for_output()]
    assert len(segments) > 1
    msg = _wire.Message(segments)
    assert msg.root(_wire.Layout.named("guest.capnp:ContainerConfig")).to_dict() == config


def test_a_double_far_pointer_reads() -> None:
    """Segment 0: a double far pointer; 1: its landing pad; 2: the struct (hand-made)."""
    inner = PY.VolumeOutcome.new_message(name="v", mounted=True, error="e").to_segments()[0]
    body = inner[8:]  # the struct and its texts, after its root pointer
    tag = int.from_bytes(inner[:8], "little") & ~(0x3FFFFFFF << 2)  # offset 0: the tag word
    pad = (2 | 1 << 2 | 0 << 3 | 1 << 32).to_bytes(8, "little")  # double far, segment 1, word 0
    landing = (2 | 0 << 3 | 2 << 32).to_bytes(8, "little") + tag.to_bytes(8, "little")
    msg = _wire.Message([pad, landing, body])
    got = msg.root(_wire.Layout.named("guest.capnp:VolumeOutcome")).to_dict()
    assert got == {"name": "v", "mounted": True, "error": "e"}


@given(states)
@settings(max_examples=80, deadline=None)
def test_our_messages_read_the_same_through_pycapnp(state: dict[str, Any]) -> None:
    b = _wire.Builder()
    root = b.init_root(_wire.Layout.named("guest.capnp:ContainerState"))
    for key, value in state.items():
        setattr(root, key, value)
    with PY.ContainerState.from_bytes(b.frame()) as r:
        assert _py_dict(r) == _defaults(_py_dict(r), state)
        assert {k: (str(v) if k == "status" else v) for k, v in
                ((k, getattr(r, k)) for k in state)} == state  # fmt: skip


@given(st.lists(st.fixed_dictionaries({"name": texts, "mounted": st.booleans(), "error": texts}),
                max_size=5), st.sampled_from(["ok", "invalidArgument", "internal"]), texts)  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_lists_of_structs_and_unions_read_through_pycapnp(
    outcomes: list[dict[str, Any]], code: str, message: str
) -> None:
    b = _wire.Builder()
    root = b.init_root(_wire.Layout.named("guest.capnp:GuestService.mountVolumes$Results"))
    root.status.code, root.status.message = code, message
    root.status.init("vmBusy")
    out = root.init("outcomes", len(outcomes))
    for target, o in zip(out, outcomes, strict=True):
        target.name, target.mounted, target.error = o["name"], o["mounted"], o["error"]
    with _results("mountVolumes").from_bytes(b.frame()) as r:
        assert [dict(name=x.name, mounted=x.mounted, error=x.error) for x in r.outcomes] == outcomes
        assert (str(r.status.code), r.status.message) == (code, message)
        assert r.status._has("vmBusy")
    m = _wire.Builder()
    call = m.init_root(_wire.Layout.named("rpc.capnp:Message")).init("call")
    call.questionId = len(outcomes)
    call.init("target").init("promisedAnswer").questionId = 7
    with RPC.Message.from_bytes(m.frame()) as r:
        assert r.which() == "call" and r.call.target.which() == "promisedAnswer"
        assert (r.call.questionId, r.call.target.promisedAnswer.questionId) == (len(outcomes), 7)


def _results(method: str) -> Any:
    schema = PY.GuestService.schema.methods[method].result_type
    return capnp.lib.capnp._StructModule(schema, f"{method}$Results")


def test_defaults_and_unions_read_as_the_schema_says() -> None:
    fin = RPC.Message.new_message()
    fin.init("finish").questionId = 3
    got = _ours(fin.to_bytes(), "rpc.capnp:Message")
    assert got == {"finish": {"questionId": 3, "releaseResultCaps": True,
                              "requireEarlyCancellationWorkaround": True}}  # fmt: skip
    b = _wire.Builder()
    f = b.init_root(_wire.Layout.named("rpc.capnp:Message")).init("finish")
    f.questionId, f.releaseResultCaps = 3, False
    with RPC.Message.from_bytes(b.frame()) as r:
        assert r.finish.releaseResultCaps is False and r.finish.requireEarlyCancellationWorkaround


def test_bad_values_are_refused_by_name() -> None:
    b = _wire.Builder()
    s = b.init_root(_wire.Layout.named("common.capnp:Status"))
    with pytest.raises(ValueError, match="no enumerant 'nope'"):
        s.code = "nope"
    with pytest.raises(AttributeError, match="no field 'colour'"):
        s.colour = 1


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_random_bytes_end_in_a_wire_error(data: bytes) -> None:
    try:
        n = _wire.frame_size(data)
        if not n or n > len(data):
            return
        root = _wire.Message.from_frame(data[:n]).root(_wire.Layout.named("rpc.capnp:Message"))
        _walk(root)
    except (_wire.WireError, UnicodeDecodeError):
        pass


def _walk(value: Any) -> None:
    if isinstance(value, _wire.StructReader):
        value.to_dict()
    elif isinstance(value, _wire.ListReader):
        for v in value:
            _walk(v)


def test_a_pointer_loop_is_refused() -> None:
    # the root: a Message whose unimplemented member (pointer 0) points back at itself
    words = [1 << 32 | 1 << 48, 0, (-2 & 0x3FFFFFFF) << 2 | 1 << 32 | 1 << 48]
    seg = b"".join(w.to_bytes(8, "little") for w in words)
    root = _wire.Message([seg]).root(_wire.Layout.named("rpc.capnp:Message"))
    with pytest.raises(_wire.WireError):
        _walk(root)


# RPC ------------------------------------------------------------------------------------------


class Stream(guest.ByteStream.Server):  # type: ignore[misc,name-defined]
    made = 0
    dropped = 0

    def __init__(self, data: bytes) -> None:
        Stream.made += 1
        self.data = data

    async def read_context(self, ctx: Any) -> None:
        n = int(ctx.params.maxBytes)
        ctx.results.data, self.data = self.data[:n], self.data[n:]
        ctx.results.eof = not self.data

    def __del__(self) -> None:
        Stream.dropped += 1


class Service(guest.GuestService.Server):  # type: ignore[misc,name-defined]
    conn: _rpc.Connection | None = None  # the guest's connection that serves it

    async def ping_context(self, ctx: Any) -> None:
        ctx.results.version, ctx.results.uptimeNs = "v1", 5

    async def logs_context(self, ctx: Any) -> None:
        ctx.results.stream = Stream(f"log of {ctx.params.name}".encode())

    async def setTime_context(self, ctx: Any) -> None:
        raise RuntimeError("no clock here")

    async def exec_context(self, ctx: Any) -> None:
        await until(self._pipelined_on)  # answers after a call pipelined on it has arrived
        ctx.results.stdout = Stream(b" ".join(s.encode() for s in ctx.params.command))

    def _pipelined_on(self) -> bool:
        """Another call waits in the connection (its target, this call's answer, is not done)."""
        assert self.conn is not None
        me = asyncio.current_task()
        return any(a.task not in (None, me) and not a.task.done()  # type: ignore[union-attr]
                   for a in self.conn.answers.values())


async def _pair(body: Any, node_bootstrap: Any = None) -> Any:
    ours, theirs = socket.socketpair()
    async with capnp.kj_loop():
        service = Service()
        conn = service.conn = _rpc.Connection(ours, service)
        running = asyncio.ensure_future(conn.run())
        stream = await capnp.AsyncIoStream.create_connection(sock=theirs)
        peer = (capnp.TwoPartyServer(stream, bootstrap=node_bootstrap) if node_bootstrap
                else capnp.TwoPartyClient(stream))  # fmt: skip
        try:
            return await body(conn, peer)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            conn.close()
            ours.close()


def test_the_node_calls_through_bootstrap_and_pipelines() -> None:
    async def body(conn: _rpc.Connection, peer: Any) -> Any:
        client = peer.bootstrap().cast_as(PY.GuestService)
        pong = await client.ping()  # pipelined on the bootstrap's question
        read = await client.logs("web").stream.read(7)  # pipelined on logs' answer
        rest = await client.logs("db").stream.read(100)
        out = await client.exec("x", ["echo", "hi"]).stdout.read(100)
        return pong.version, pong.uptimeNs, read.data, read.eof, rest.data, rest.eof, out.data

    got = asyncio.run(_pair(body))
    assert got == ("v1", 5, b"log of ", False, b"log of db", True, b"echo hi")


def test_returned_capabilities_are_released_when_the_node_drops_them() -> None:
    async def body(conn: _rpc.Connection, peer: Any) -> Any:
        client = peer.bootstrap().cast_as(PY.GuestService)
        await client.ping()
        before = len(conn.exports)
        stream = (await client.logs("web")).stream
        held = len(conn.exports)
        await stream.read(3)
        del stream
        with contextlib.suppress(TimeoutError):
            await until(lambda: len(conn.exports) == before, within=0.5)
        return before, held, len(conn.exports)

    Stream.dropped = Stream.made = 0
    before, held, after = asyncio.run(_pair(body))
    assert (held, after) == (before + 1, before)
    assert Stream.made == 1


def test_exceptions_and_unknown_methods_reach_the_node_by_name() -> None:
    async def body(conn: _rpc.Connection, peer: Any) -> Any:
        client = peer.bootstrap().cast_as(PY.GuestService)
        errors = []
        for call in (lambda: client.setTime(5), lambda: client.shutdown(False)):
            with pytest.raises(capnp.KjException) as e:
                await call()
            errors.append(str(e.value))
        return errors, await client.ping()

    (failed, unimplemented), pong = asyncio.run(_pair(body))
    assert "RuntimeError: no clock here" in failed
    assert "GuestService.shutdown is not implemented" in unimplemented
    assert pong.version == "v1"  # the connection goes on


ATTACHED: list[tuple[str, str, str]] = []


class Node(PY.NodeService.Server):  # type: ignore[misc,name-defined]
    async def attach(self, version: str, bootId: str, session: str, **kwargs: Any) -> None:
        ATTACHED.append((version, bootId, session))


def test_the_guest_calls_the_node_s_bootstrap() -> None:
    async def body(conn: _rpc.Connection, peer: Any) -> Any:
        node = conn.bootstrap().cast_as(guest.NodeService)
        first = await node.attach("v1", "boot", "s1")  # pipelined on the bootstrap
        second = await node.attach(version="v1", bootId="boot", session="s2")
        return str(first.status.code), str(second.status.code), node._target[0]

    ATTACHED.clear()
    got = asyncio.run(_pair(body, node_bootstrap=Node()))
    assert got == ("ok", "ok", "import")
    assert ATTACHED == [("v1", "boot", "s1"), ("v1", "boot", "s2")]


def test_a_closed_connection_fails_what_waits() -> None:
    async def body() -> Any:
        ours, theirs = socket.socketpair()
        service = Service()
        conn = service.conn = _rpc.Connection(ours, service)
        running = asyncio.ensure_future(conn.run())
        node = conn.bootstrap().cast_as(guest.NodeService)
        waiting = asyncio.ensure_future(node.attach("v", "b", "s"))
        await idle()  # its question is asked
        assert not waiting.done()
        theirs.close()
        with pytest.raises(EOFError):
            await running
        with pytest.raises(_rpc.RpcError, match="ended"):
            await waiting
        with pytest.raises(_rpc.RpcError):
            await node.attach("v", "b", "s")
        ours.close()

    asyncio.run(body())


def _frame(fill: Any) -> bytes:
    b = _wire.Builder()
    fill(b, b.init_root(_rpc.MESSAGE))
    return b.frame()


def _bootstrap(b: Any, m: Any) -> None:
    m.init("bootstrap").questionId = 0


def _call(method: str, bad_text: bool = False) -> Any:
    def fill(b: Any, m: Any) -> None:
        call = m.init("call")
        call.questionId, call.interfaceId = 1, guest.GuestService.id
        call.methodId = method_id = guest.GuestService.method_ids[method]
        call.init("target").init("promisedAnswer").questionId = 0
        params = guest.GuestService.methods[method_id][1]
        content = call.init("params").init_any("content", _wire.Layout.of(params))
        if bad_text:  # its first pointer (pullImage's reference): out of the message
            b.put_word(content._ptr, _wire._list_pointer(1000, 2, 5))

    return fill


def _finish_bootstrap(b: Any, m: Any) -> None:
    m.init("finish").questionId = 0


def _answer(server: Any, frames: list[bytes], method: str) -> Any:
    """Our raw frames to a Connection serving server, sent in one write; the results of q1."""

    async def body() -> Any:
        ours, theirs = socket.socketpair()
        conn = _rpc.Connection(ours, server)
        running = asyncio.ensure_future(conn.run())
        theirs.sendall(b"".join(frames))
        theirs.setblocking(False)
        loop, buf = asyncio.get_running_loop(), b""
        try:
            while True:
                buf += await loop.sock_recv(theirs, 65536)
                while (n := _wire.frame_size(buf)) and len(buf) >= n:
                    root = _wire.Message.from_frame(buf[:n]).root(_rpc.MESSAGE)
                    buf = buf[n:]
                    ret = root.__getattr__("return") if root.which() == "return" else None
                    if ret is not None and ret.answerId == 1:
                        assert ret.which() == "results", ret
                        layout = _wire.Layout.named(f"guest.capnp:GuestService.{method}$Results")
                        return _rpc._struct(ret.results.pointer("content"), layout)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            conn.close()
            ours.close()
            theirs.close()

    return asyncio.run(body())


def test_a_call_pipelined_then_finished_at_once_is_answered() -> None:
    """The node's C++ finishes its bootstrap question right after the calls it pipelined on it."""
    got = _answer(Service(), [_frame(_bootstrap), _frame(_call("ping")),
                              _frame(_finish_bootstrap)], "ping")  # fmt: skip
    assert (got.version, got.uptimeNs) == ("v1", 5)


def test_parameters_that_do_not_decode_are_invalid_argument() -> None:
    """A Call to the agent's own service whose text points out of its message."""
    from types import SimpleNamespace

    from feos.guest._service import GuestServer

    agent = SimpleNamespace(images=SimpleNamespace(pull=None))  # the call never gets there
    got = _answer(GuestServer(agent), [_frame(_bootstrap), _frame(_call("pullImage", True))],
                  "pullImage")  # fmt: skip
    assert got.status.code == "invalidArgument"
    assert "pullImage: a request that does not decode: an object out of segment 0" in (
        got.status.message
    )
