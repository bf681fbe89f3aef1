"""The node connections' calls: a path and a Cap'n Proto body in, an answer out, run where the
socket runs them.

Theory of operation: a stream's path names the method as the bootstrap and the schema name them
(`/volumes/getVolume`); its body is the method's params struct as one Cap'n Proto message. The
`Dispatcher` decodes the body into the params' dict on the link's thread (as the RPC server's
`to_dict`), then runs the service's snake_case method where the socket's server runs it:

- a trio method on feosd's trio runtime: handed over with `main_token.run_sync_soon` as a system
  task in a cancel scope of its own, its answer handed back to the link's trio run the same way
  (no thread blocks per call); the results message is made there too, so the link's threads do
  no work of the services;
- a method marked `on_rpc_thread` that is a coroutine (a relay's read) on the Cap'n Proto thread;
- a plain read marked `on_rpc_thread` (state replaced whole, never blocking: GetVolume) at once
  on the link's thread, as the socket answers it on the Cap'n Proto thread without a trip to trio.

A wait the link drops (the control plane reset the stream, the stop's grace ran out) cancels
the call where it runs; a pod's change goes on, shielded by the pod service as for the socket.

A result that holds a capability (watchEvents' EventStream, podLogs', consoleLog's and
execInPod's ByteStream) makes the answer a stream: `Answer.items` pulls the capability (`next`
or `read`) and hands out each pull's results as one message, until `end` or `exited`; closing
it lets go of the capability. execInPod's stdin is closed at once: a node connection carries
no input yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
import trio
from capnp.lib import capnp as _capnp

from .. import _schema
from .._codec import snake
from ..errors import Code, FeosError
from ..rpc import Cap, status_dict

log = logging.getLogger(__name__)

T = TypeVar("T")

STOPPING = "feosd stops"
TRAVERSAL_LIMIT_WORDS = 8 * 1024 * 1024  # 64 MiB read from a 16 MiB body at most
NESTING_LIMIT = 64

# The bootstrap's names -> their interfaces (schema/feos.capnp).
INTERFACES: dict[str, Callable[[], Any]] = {
    "pods": lambda: _schema.pod().PodService,
    "volumes": lambda: _schema.volume().VolumeService,
    "securityGroups": lambda: _schema.network().SecurityGroupService,
    "names": lambda: _schema.network().NameService,
    "traffic": lambda: _schema.network().TrafficService,
    "host": lambda: _schema.host().HostService,
    "mesh": lambda: _schema.network().MeshService,
}

# A capability's interface (its name) -> how it is pulled: method, params, the key of its end.
PULLS: dict[str, tuple[str, dict[str, Any], str]] = {
    "EventStream": ("next", {"max": 256}, "end"),
    "ByteStream": ("read", {}, "exited"),
}


@attrs.frozen
class Answer:
    """What a call answers: the status (the trailers), the results message (the body, None for
    a trailers-only answer), the HTTP status, and for a stream its items after the body."""

    code: Code
    message: str
    body: bytes | None
    http_status: int = 200
    items: Items | None = None


@attrs.frozen
class _Method:
    name: str
    target: Any  # the service's bound method; None: not built
    params: Any  # the params' struct module
    results: Any
    plain: bool  # a plain read (_plain_read), answered at once on the link's thread


def _struct(schema: Any, name: str) -> Any:
    return _capnp._StructModule(schema, name)


def encode(results: Any, values: Mapping[str, Any]) -> tuple[bytes, Cap | None]:
    """The results message of `values` (as the RPC server writes them); the capability kept
    aside, unset in the message."""
    builder = results.new_message()
    cap = None
    for key, value in values.items():
        if isinstance(value, Cap):
            cap = value
        elif value is not None:
            setattr(builder, key, value)
    return builder.to_bytes(), cap


def error_body(results: Any, exc: FeosError) -> bytes:
    return bytes(results.new_message(status=status_dict(exc)).to_bytes())


def decode(params: Any, body: bytes) -> dict[str, Any]:
    """The params' dict of a body (an empty one: every field unset); INVALID_ARGUMENT if it is
    not one message of them."""
    if not body:
        return {}
    try:
        with params.from_bytes(body, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS,
                               nesting_limit=NESTING_LIMIT) as reader:
            return reader_dict(reader)
    except Exception as exc:  # KjException and what pycapnp raises on a body that is no message
        text = getattr(exc, "description", None) or str(exc)
        raise FeosError(Code.INVALID_ARGUMENT,
                        f"the body is not the method's params: {text.splitlines()[0]}") from None


def reader_dict(reader: Any) -> dict[str, Any]:
    """A struct reader's dict, as pycapnp's `to_dict()` gives it (tests/unit/test_fleet_calls.py
    compares them): to_dict asks every struct for its union's member, and one that has no union
    answers with an exception, which cost a GetVolume's decode four fifths of its time."""
    schema = reader.schema
    found: dict[str, Any] = {}
    if schema.union_fields:
        try:
            which = reader._which_str()
        except _capnp.KjException:  # a member this schema does not know: to_dict leaves it out
            pass
        else:
            found[which] = _value(reader._get(which))
    for field in schema.non_union_fields:
        if reader._has(field):
            found[field] = _value(reader._get(field))
    return found


def _value(value: Any) -> Any:
    kind = type(value)
    if kind is _capnp._DynamicStructReader:
        return reader_dict(value)
    if kind is _capnp._DynamicListReader:
        return [_value(value._get(i)) for i in range(len(value))]
    if kind is _capnp._DynamicEnum:
        return str(value)
    if kind is memoryview:
        return bytes(value)
    return value


class Dispatcher:
    """feosd's services, by the bootstrap's names ("volumes", "pods", ...), for the node
    connections; `main_token` is feosd's trio runtime's, `bridge` the Cap'n Proto thread (for
    the relays of exec and logs, which live there)."""

    def __init__(self, services: Mapping[str, object], main_token: trio.lowlevel.TrioToken, *,
                 bridge: Any = None) -> None:
        self._services = services
        self._token = main_token
        self._bridge = bridge
        self._methods: dict[str, _Method] = {}

    def method(self, path: str) -> _Method | None:
        """The method a path names, or None."""
        found = self._methods.get(path)
        if found is None:
            found = self._find(path)
            if found is not None:  # paths that name nothing are not kept: there is no end to them
                self._methods[path] = found
        return found

    def _find(self, path: str) -> _Method | None:
        service, sep, name = path.removeprefix("/").partition("/")
        interface = INTERFACES.get(service)
        if not sep or interface is None:
            return None
        methods = interface().schema.methods
        if name not in methods:
            return None
        impl = self._services.get(service)
        target = getattr(impl, snake(name), None) if impl is not None else None
        m = methods[name]
        return _Method(name, target, _struct(m.param_type, f"{name}$Params"),
                       _struct(m.result_type, f"{name}$Results"), _plain_read(target))

    def answer_now(self, path: str, body: bytes) -> Answer | None:
        """The answer of a plain read (GetVolume) or of a path that names no call, made at once
        on the link's thread; None for a call that runs elsewhere (`call` it then)."""
        method = self.method(path)
        if method is not None and not method.plain:
            return None
        return self._unrun(path, method, body) or self._read(method, body)

    def _unrun(self, path: str, method: _Method | None, body: bytes) -> Answer | None:
        """The answer of a call that runs nowhere: no such method, a body that is not its
        params, a method not built."""
        if method is None:
            return Answer(Code.UNIMPLEMENTED, f"{path}: no such method", None, http_status=404)
        if method.target is None:
            missing = FeosError(Code.UNIMPLEMENTED, f"{method.name} is not built yet")
            return Answer(missing.code, missing.message, error_body(method.results, missing))
        return None

    def _read(self, method: Any, body: bytes) -> Answer:
        try:
            params = decode(method.params, body)
        except FeosError as exc:
            return Answer(exc.code, exc.message, None)
        try:
            return self._answer(method, method.target(params) or {})
        except Exception as exc:
            return _failed(method.name, method.results, exc)

    async def call(self, path: str, body: bytes) -> Answer:
        """One call, on the link's trio run; cancelling the wait cancels the call. Every
        outcome is an answer (UNAVAILABLE "feosd stops" once feosd's runtime has ended)."""
        method = self.method(path)
        unrun = self._unrun(path, method, body)
        if unrun is not None:
            return unrun
        assert method is not None
        if method.plain:
            return self._read(method, body)
        try:
            params = decode(method.params, body)
        except FeosError as exc:
            return Answer(exc.code, exc.message, None)
        try:
            answer = await self._run(method.target, lambda values: self._answer(method, values),
                                     params, method.name, method.results)
        except FeosError as exc:  # feosd's runtime or the Cap'n Proto thread has ended
            return Answer(exc.code, exc.message, error_body(method.results, exc))
        if answer.items is not None and method.name == "execInPod":
            await answer.items.close_input()
        return answer

    def _answer(self, method: _Method, values: Mapping[str, Any]) -> Answer:
        body, cap = encode(method.results, values)
        items = Items(self, cap, method.name) if cap is not None else None
        return Answer(Code.OK, "", body, items=items)

    async def _run(self, target: Any, make: Callable[[Mapping[str, Any]], T],
                   params: dict[str, Any], name: str, results: Any = None) -> T | Answer:
        """`target(params)` where it lives, made into an answer there with `make`; a FeosError
        (or any other failure, as INTERNAL) as its status."""

        async def home() -> T | Answer:
            try:
                values = target(params)
                if inspect.isawaitable(values):
                    values = await values
                return make(values or {})
            except Exception as exc:
                return _failed(name, results, exc)

        if _plain_read(target):
            try:
                return make(target(params) or {})  # a plain read: at once, here
            except Exception as exc:
                return _failed(name, results, exc)
        if getattr(target, "_feos_rpc_thread", False):
            return await self._on_capnp(home)
        return await self.on_main(home)

    async def on_main(self, fn: Callable[[], Awaitable[T]]) -> T:
        """On the link's run: fn() as a task of feosd's trio runtime; its result back here."""
        call = _MainCall(fn, trio.lowlevel.current_trio_token())
        try:
            self._token.run_sync_soon(self._spawn, call)
        except trio.RunFinishedError:
            raise FeosError(Code.UNAVAILABLE, STOPPING) from None
        try:
            await call.done.wait()
        except BaseException:
            call.dropped = True
            self._soon(call.cancel)
            raise
        result: T = call.result()
        return result

    def _soon(self, fn: Callable[[], object]) -> None:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    def _spawn(self, call: _MainCall) -> None:
        if call.dropped:
            return
        trio.lowlevel.spawn_system_task(call.run, name=f"node call {call.fn!r}")

    async def _on_capnp(self, fn: Callable[[], Awaitable[T]]) -> T:
        if self._bridge is None:
            raise FeosError(Code.UNAVAILABLE, "no Cap'n Proto thread")
        link = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = asyncio.run_coroutine_threadsafe(_coro(fn), self._bridge.loop)
        future.add_done_callback(lambda _f: _wake(link, done))
        try:
            await done.wait()
        finally:
            if not future.done():
                future.cancel()
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise FeosError(Code.UNAVAILABLE, STOPPING) from None


def _plain_read(target: Any) -> bool:
    """A read marked on_rpc_thread that is no coroutine: state replaced whole, never blocking."""
    return bool(getattr(target, "_feos_rpc_thread", False)) and \
        not asyncio.iscoroutinefunction(target)


def _failed(name: str, results: Any, exc: Exception) -> Answer:
    if not isinstance(exc, FeosError):
        log.error("%s failed: %r", name, exc)
        exc = FeosError(Code.INTERNAL, f"{name}: {exc}")
    return Answer(exc.code, exc.message, error_body(results, exc) if results is not None else None)


async def _coro(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


def _wake(token: trio.lowlevel.TrioToken, event: trio.Event) -> None:
    try:
        token.run_sync_soon(event.set)
    except trio.RunFinishedError:
        pass


class _MainCall:
    """One call handed to feosd's runtime, and its way back to the link's run."""

    def __init__(self, fn: Callable[[], Awaitable[Any]], link: trio.lowlevel.TrioToken) -> None:
        self.fn = fn
        self.link = link
        self.done = trio.Event()  # the link run's
        self.dropped = False
        self._scope: trio.CancelScope | None = None
        self._outcome: tuple[bool, Any] = (False, FeosError(Code.UNAVAILABLE, STOPPING))

    async def run(self) -> None:
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                if self.dropped:
                    scope.cancel()
                try:
                    self._outcome = (True, await self.fn())
                except Exception as exc:
                    self._outcome = (False, exc)
        finally:
            _wake(self.link, self.done)

    def cancel(self) -> None:
        self.dropped = True
        if self._scope is not None:
            self._scope.cancel()

    def result(self) -> Any:
        ok, value = self._outcome
        if ok:
            return value
        raise value


class Items:
    """A stream's items: each pull of its capability as one results message."""

    def __init__(self, dispatcher: Dispatcher, cap: Cap, method: str) -> None:
        self._dispatcher = dispatcher
        self._impl = cap.impl
        kind = str(cap.interface.schema.node.displayName).rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        pull, self._params, self._end = PULLS[kind]
        m = cap.interface.schema.methods[pull]
        self._results = _struct(m.result_type, f"{pull}$Results")
        self._pull = getattr(self._impl, pull)
        self._method = method
        self.ended = False

    async def next(self) -> bytes | None:
        """The next item's message; None once the stream has ended. A FeosError ends it with
        its status."""
        if self.ended:
            return None
        answer = await self._dispatcher._run(self._pull, self._item, dict(self._params),
                                             self._method)
        if isinstance(answer, Answer):
            self.ended = True
            raise FeosError(answer.code, answer.message)
        body, end = answer
        if end:
            self.ended = True
        return body

    def _item(self, values: Mapping[str, Any]) -> tuple[bytes, bool]:
        body, _ = encode(self._results, values)
        return body, bool(values.get(self._end))

    async def close_input(self) -> None:
        """An exec's stdin, closed: a node connection carries no input."""
        write = getattr(self._impl, "write", None)
        if write is not None:
            await self._dispatcher._run(write, lambda _v: None, {"close": True}, self._method)

    def close(self) -> None:
        """Let go of the capability, as a client's release does (from the link's thread)."""
        self.ended = True
        released = getattr(self._impl, "released", None)
        if callable(released):
            released()  # thread-safe: it hands its work to its own loop
            return
        close = getattr(self._impl, "close", None)
        if callable(close):
            self._dispatcher._soon(close)  # a watcher's close sets trio events of feosd's runtime
