"""Cap'n Proto's two-party RPC (rpc.capnp, level 1) on asyncio, for the guest, in plain Python.

One Connection serves one session on a stream socket: the peer's calls go to our servers (its
bootstrap is ours, each capability we return is an export it releases), and our calls go to its
capabilities (its bootstrap, NodeService). What the node's C++ RPC sends is handled: Bootstrap,
Call (to an export, or pipelined on one of our answers through its transform), Return, Finish,
Release, Resolve of a promise it sent, Abort, Unimplemented. Calls on one capability run
concurrently, each in its task, as pycapnp's servers do. Not implemented (the agent needs none,
and the node never sends them to it): Disembargo (answered Unimplemented), level 3 (Provide,
Accept, Join), tail calls; a call to a capability the peer itself hosts and we pass back.

A server is a subclass of an interface's Server class (`guest.GuestService.Server`), with a
coroutine `<method>_context(ctx)` per method: ctx.params reads the call, ctx.results builds the
answer. Setting a server into a capability field of the results exports it.
"""

from __future__ import annotations

import asyncio

from . import _layout
from ._wire import (
    Builder,
    Layout,
    Message,
    StructReader,
    WireError,
    frame_size,
    read_pointer,
    struct_at,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MESSAGE = Layout.named("rpc.capnp:Message")
READ_SIZE = 1 << 16
MAX_FRAME = 64 << 20  # a message larger than this ends the connection


class RpcError(Exception):
    """A call the peer answered with an exception, or a connection that ended under it."""

    def __init__(self, reason: str, kind: str = "failed") -> None:
        super().__init__(reason)
        self.kind = kind


class Interface:
    """An interface of a schema: its methods by ordinal, and the Server class to implement it."""

    def __init__(self, node_id: int) -> None:
        self.id = node_id
        self.name, self.methods, self.supers = _layout.INTERFACES[node_id]
        self.Server = type("Server", (Server,), {"_interface": self})
        self.method_ids = {m[0]: i for i, m in enumerate(self.methods)}


class Server:
    """Base of every interface's Server class (the class attribute _interface says which)."""

    _interface: Interface


class Schema:
    """The top-level names of a schema file: interfaces as Interface, structs as Layout."""

    def __init__(self, file: str) -> None:
        prefix = f"{file}:"
        for name, node_id in _layout.NAMES.items():
            local = name[len(prefix) :]
            if not name.startswith(prefix) or "." in local or "$" in local:
                continue
            if node_id in _layout.INTERFACES:
                setattr(self, local, Interface(node_id))
            elif node_id in _layout.STRUCTS:
                setattr(self, local, Layout.of(node_id))


class Context:
    __slots__ = ("params", "results")

    def __init__(self, params: StructReader, results: Any) -> None:
        self.params, self.results = params, results


class Client:
    """A capability of the peer: an import, or our question's answer until it returns."""

    def __init__(self, conn: Connection, interface: Interface | None, target: tuple[str, int]):
        self._conn, self._interface, self._target = conn, interface, target

    def cast_as(self, interface: Interface) -> Client:
        """This capability, called as interface (the same object: a bootstrap resolves in it)."""
        self._interface = interface
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self._interface is None:
            raise AttributeError(name)
        iface = self._interface
        if name not in iface.method_ids:
            raise AttributeError(f"{iface.name} has no method {name!r}")

        async def call(*args: Any, **kwargs: Any) -> StructReader:
            return await self._conn.call(self, iface, name, args, kwargs)

        return call


class _Answer:
    """Our answer to one of the peer's questions: done once its Return went out."""

    __slots__ = ("caps", "done", "exports", "reader", "release_when_done", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done: asyncio.Future[None] = loop.create_future()
        self.reader: tuple[Message, int, int] | None = None  # where the Return's content is
        self.caps: list[Any] = []  # what its cap table named, by index
        self.exports: list[int] = []  # the export ids it holds a reference to
        self.release_when_done = False  # set by a Finish that comes before the Return
        self.task: asyncio.Future[None] | None = None


class Connection:
    def __init__(self, sock: Any, bootstrap: Server | None) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.bootstrap_server = bootstrap
        self.exports: dict[int, list[Any]] = {}  # id -> [server, references]
        self.export_ids: dict[int, int] = {}  # id(server) -> its export id
        self.next_export = 0
        self.questions: dict[int, asyncio.Future[Any]] = {}
        self.next_question = 0
        self.answers: dict[int, _Answer] = {}
        self.out = bytearray()
        self.closed: BaseException | None = None

    # The loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reads and handles the peer's messages until it closes (EOFError) or aborts."""
        buf = bytearray()
        try:
            while True:
                try:
                    data = await self.loop.sock_recv(self.sock, READ_SIZE)
                except OSError as e:  # a reset: the peer went with our bytes unread
                    raise EOFError(f"the RPC connection broke: {e}") from e
                if not data:
                    raise EOFError("the peer closed the RPC connection")
                buf += data
                while True:
                    n = frame_size(buf)
                    if n > MAX_FRAME:
                        raise WireError(f"a message of {n} bytes (at most {MAX_FRAME})")
                    if not n or len(buf) < n:
                        break
                    frame = bytes(buf[:n])
                    del buf[:n]
                    self.handle(Message.from_frame(frame))
        except WireError as e:
            self.abort(f"a message that does not decode: {e}")
            raise
        finally:
            self.close(EOFError("the RPC connection ended"))

    def close(self, why: BaseException | None = None) -> None:
        if self.closed is not None:
            return
        self.closed = why or EOFError("the RPC connection was closed")
        for fut in self.questions.values():
            if not fut.done():
                fut.set_exception(RpcError(str(self.closed), "disconnected"))
        self.questions.clear()
        for ans in self.answers.values():
            if ans.task is not None:
                ans.task.cancel()
        self.answers.clear()
        self.exports.clear()
        self.export_ids.clear()
        if self.sock.fileno() >= 0:
            self.loop.remove_writer(self.sock.fileno())

    def abort(self, reason: str) -> None:
        b = Builder()
        e = b.init_root(MESSAGE).init("abort")
        e.reason, e.type = reason, "failed"
        self.send(b)

    def send(self, b: Builder) -> None:
        if self.closed is not None:
            return
        frame = b.frame()
        if not self.out:
            try:
                sent = self.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self.close(e)
                return
            if sent == len(frame):
                return
            frame = frame[sent:]
            self.loop.add_writer(self.sock.fileno(), self._flush)
        self.out += frame

    def _flush(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.loop.remove_writer(self.sock.fileno())
            self.close(e)
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.sock.fileno())

    # The peer's messages --------------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        root = msg.root(MESSAGE)
        which = root.which()
        handler = getattr(self, f"_on_{which}", None)
        if handler is None:
            self.abort(f"the guest's RPC does not implement {which} messages")
            raise EOFError(f"the peer sent a {which} message")
        handler(getattr(root, which))

    def _on_bootstrap(self, m: StructReader) -> None:
        qid = m.questionId
        ans = self._new_answer(qid)
        b, ret = self._return(qid)
        payload = ret.init("results")
        payload.set_any_cap("content", self.bootstrap_server)
        self._send_return(b, payload, ans)

    def _on_call(self, m: StructReader) -> None:
        qid = m.questionId
        target = self._target_now(m.target)  # before a Finish or Release that follows it
        ans = self._new_answer(qid)
        params = m.params
        m._msg.caps = [self._cap_in(d) for d in params.capTable]
        ans.task = asyncio.ensure_future(self._serve(qid, ans, m, params, target))

    def _new_answer(self, qid: int) -> _Answer:
        if qid in self.answers:
            raise WireError(f"question {qid} asked twice")
        ans = self.answers[qid] = _Answer(self.loop)
        return ans

    async def _serve(self, qid: int, ans: _Answer, m: StructReader, params: StructReader,
                     target: Any) -> None:  # fmt: skip
        b, ret = self._return(qid)
        try:
            server = await self._target(target)
            iface = server._interface
            if m.interfaceId != iface.id or m.methodId >= len(iface.methods):
                raise RpcError(f"{iface.name} has no method {m.interfaceId:#x}.{m.methodId}",
                               "unimplemented")  # fmt: skip
            name, param_id, result_id = iface.methods[m.methodId]
            method = getattr(server, f"{name}_context", None)
            if method is None:
                raise RpcError(f"{iface.name}.{name} is not implemented", "unimplemented")
            content = _struct(params.pointer("content"), Layout.of(param_id))
            payload = ret.init("results")
            await method(Context(content, payload.init_any("content", Layout.of(result_id))))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the peer gets it as the call's exception
            b, ret = self._return(qid)
            exc = ret.init("exception")
            exc.reason = f"{type(e).__name__}: {e}" if not isinstance(e, RpcError) else str(e)
            exc.type = e.kind if isinstance(e, RpcError) else "failed"
            self._finish_answer(ans, b)
            return
        self._send_return(b, payload, ans)

    def _return(self, qid: int) -> tuple[Builder, Any]:
        b = Builder()
        ret = b.init_root(MESSAGE).init("return")
        ret.answerId = qid
        ret.releaseParamCaps = False
        return b, ret

    def _send_return(self, b: Builder, payload: Any, ans: _Answer) -> None:
        """The Return with its cap table: each of our servers in it exported (one reference)."""
        caps = list(b.caps)
        table = payload.init("capTable", len(caps))
        for d, cap in zip(table, caps, strict=True):
            if cap is None:
                d.none = None
            elif isinstance(cap, Client) and cap._target[0] == "import":
                d.receiverHosted = cap._target[1]
            elif isinstance(cap, Server):
                export = self._export(cap)
                ans.exports.append(export)
                d.senderHosted = export
            else:
                raise TypeError(f"cannot send {type(cap).__name__} as a capability")
        kept = Message([b.buf], caps)  # for calls pipelined on it (payload.content: pointer 0)
        ans.reader = (kept, 0, payload._ptr)
        ans.caps = caps
        self._finish_answer(ans, b)

    def _finish_answer(self, ans: _Answer, b: Builder) -> None:
        """The answer is done; its Return goes out."""
        ans.done.set_result(None)
        self.send(b)
        if ans.release_when_done:  # the peer finished it while it ran, releasing its caps
            self._release_answer(ans)

    def _export(self, server: Server) -> int:
        export = self.export_ids.get(id(server))
        if export is None:
            export = self.next_export
            self.next_export += 1
            self.exports[export] = [server, 0]
            self.export_ids[id(server)] = export
        self.exports[export][1] += 1
        return export

    def _release(self, export: int, count: int) -> None:
        entry = self.exports.get(export)
        if entry is None:
            return
        entry[1] -= count
        if entry[1] <= 0:
            del self.exports[export]
            self.export_ids.pop(id(entry[0]), None)

    def _release_answer(self, ans: _Answer) -> None:
        for export in ans.exports:
            self._release(export, 1)
        ans.exports = []

    def _target_now(self, target: StructReader) -> Any:
        """Where a call goes, as it arrives: a server, (an answer, its transform) to wait for, or
        the RpcError to answer with. The peer may finish the answer or release the export right
        after the call; the call goes where it was sent all the same."""
        which = target.which()
        if which == "importedCap":
            entry = self.exports.get(target.importedCap)
            if entry is None:
                return RpcError(f"no capability {target.importedCap} is exported to the node")
            return entry[0]
        pa = target.promisedAnswer
        ans = self.answers.get(pa.questionId)
        if ans is None:
            return RpcError(f"a call pipelined on question {pa.questionId}, which has no answer")
        ops = [op.getPointerField if op.which() == "getPointerField" else -1 for op in pa.transform]
        return ans, pa.questionId, ops

    async def _target(self, where: Any) -> Server:
        if isinstance(where, RpcError):
            raise where
        if isinstance(where, Server):
            return where
        ans, qid, ops = where
        await asyncio.shield(ans.done)
        if ans.reader is None:
            raise RpcError(f"a call pipelined on question {qid}, which failed")
        cap = _walk(ans.reader, ops)
        if not isinstance(cap, Server):
            raise RpcError("a call pipelined on a capability the guest does not host")
        return cap

    def _on_finish(self, m: StructReader) -> None:
        ans = self.answers.pop(m.questionId, None)
        if ans is None:
            return
        if not ans.done.done():
            ans.release_when_done = m.releaseResultCaps  # it answers all the same
        elif m.releaseResultCaps:
            self._release_answer(ans)

    def _on_release(self, m: StructReader) -> None:
        self._release(m.id, m.referenceCount)

    def _on_return(self, m: StructReader) -> None:
        qid = m.answerId
        fut = self.questions.pop(qid, None)
        if not m.noFinishNeeded:
            b = Builder()
            fin = b.init_root(MESSAGE).init("finish")
            fin.questionId, fin.releaseResultCaps = qid, False
            self.send(b)
        if fut is None or fut.done():
            return
        which = m.which()
        if which == "results":
            payload = m.results
            m._msg.caps = [self._cap_in(d) for d in payload.capTable]
            fut.set_result(payload.pointer("content"))
        elif which == "exception":
            fut.set_exception(RpcError(m.exception.reason, str(m.exception.type)))
        else:
            fut.set_exception(RpcError(f"the node's Return was {which}"))

    def _on_resolve(self, m: StructReader) -> None:
        pass  # the node sends no promises to the guest: its caps are resolved when sent

    def _on_abort(self, m: StructReader) -> None:
        raise EOFError(f"the node aborted the RPC connection: {m.reason}")

    def _on_unimplemented(self, m: StructReader) -> None:
        if m.which() in ("call", "bootstrap"):
            inner = getattr(m, m.which())
            fut = self.questions.pop(inner.questionId, None)
            if fut is not None and not fut.done():
                fut.set_exception(RpcError("the node does not implement it", "unimplemented"))

    def _on_disembargo(self, m: StructReader) -> None:
        self.abort("the guest's RPC does not implement Disembargo (it passes no promises)")
        raise EOFError("the peer sent a Disembargo")

    def _cap_in(self, d: StructReader) -> Any:
        which = d.which()
        if which in ("senderHosted", "senderPromise"):
            return Client(self, None, ("import", getattr(d, which)))
        if which == "receiverHosted":
            entry = self.exports.get(d.receiverHosted)
            return entry[0] if entry else None
        return None

    # Our calls ------------------------------------------------------------------------------

    def bootstrap(self) -> Client:
        """The peer's bootstrap: a client that pipelines on the question until it returns."""
        qid = self._question()
        b = Builder()
        b.init_root(MESSAGE).init("bootstrap").questionId = qid
        client = Client(self, None, ("answer", qid))
        fut: asyncio.Future[Any] = self.loop.create_future()
        fut.add_done_callback(lambda f: self._bootstrapped(f, client))
        self.questions[qid] = fut
        self.send(b)
        return client

    def _bootstrapped(self, fut: asyncio.Future[Any], client: Client) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        msg, seg, at = fut.result()
        cap = _read_cap(msg, seg, at)
        if isinstance(cap, Client):
            client._target = cap._target

    def _question(self) -> int:
        if self.closed is not None:
            raise RpcError(str(self.closed), "disconnected")
        qid = self.next_question
        self.next_question += 1
        return qid

    async def call(self, client: Client, iface: Interface, name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> StructReader:  # fmt: skip
        method_id = iface.method_ids[name]
        _, param_id, result_id = iface.methods[method_id]
        qid = self._question()
        b = Builder()
        call = b.init_root(MESSAGE).init("call")
        call.questionId, call.interfaceId, call.methodId = qid, iface.id, method_id
        target = call.init("target")
        kind, ref = client._target
        if kind == "import":
            target.importedCap = ref
        else:
            target.init("promisedAnswer").questionId = ref
        payload = call.init("params")
        params = payload.init_any("content", Layout.of(param_id))
        for field, value in zip(Layout.of(param_id).fields, args, strict=False):
            setattr(params, field, value)
        for field, value in kwargs.items():
            setattr(params, field, value)
        payload.init("capTable", 0)
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.questions[qid] = fut
        self.send(b)
        msg, seg, at = await fut
        return _struct((msg, seg, at), Layout.of(result_id))


def _struct(where: tuple[Message, int, int], layout: Layout) -> StructReader:
    msg, seg, at = where
    return struct_at(msg, seg, at, layout, 0)


def _read_cap(msg: Message, seg: int, at: int) -> Any:
    return read_pointer(msg, seg, at, ("cap", None), 0)


def _walk(where: tuple[Message, int, int], ops: list[int]) -> Any:
    """The capability at the end of a promised answer's transform (pointer field indexes)."""
    msg, seg, at = where
    for op in ops:
        if op < 0:  # noop
            continue
        if msg.word(seg, at) == 0:
            return None
        seg, start, tag = msg.resolve(seg, at)
        if tag & 3 != 0:
            raise RpcError("a pipelined call's transform goes through a pointer not a struct")
        data, ptrs = (tag >> 32) & 0xFFFF, tag >> 48
        if op >= ptrs:
            return None
        at = start + data + op
    return _read_cap(msg, seg, at)
