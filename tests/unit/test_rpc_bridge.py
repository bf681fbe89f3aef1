"""The trio/asyncio bridge: both directions, errors, cancellation, and a stop with calls in flight."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from feos.errors import Code, FeosError
from feos.rpc._bridge import CapnpThread, capnp_thread


async def test_call_runs_on_the_capnp_thread() -> None:
    async with capnp_thread() as bridge:

        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert await bridge.call(where) == "capnp"


async def test_call_raises_what_the_coroutine_raised() -> None:
    async with capnp_thread() as bridge:

        async def fail() -> None:
            raise FeosError(Code.NOT_FOUND, "no such thing")

        with pytest.raises(FeosError) as caught:
            await bridge.call(fail)
        assert caught.value.code is Code.NOT_FOUND


class _Freed:
    """Says on which thread it was freed (a Cap'n Proto reader must be freed on "capnp")."""

    def __init__(self, where: list[str]) -> None:
        self.where = where

    def __del__(self) -> None:
        self.where.append(threading.current_thread().name)


async def test_what_a_failed_call_held_is_freed_on_the_capnp_thread() -> None:
    where: list[str] = []
    async with capnp_thread() as bridge:

        async def inner() -> None:
            held = _Freed(where)  # as a caller's results reader is, when it raises
            raise FeosError(Code.INTERNAL, f"failed with {type(held).__name__}")

        async def fail() -> None:
            try:
                await inner()
            except FeosError as e:  # chained: its frames are cleared too
                raise FeosError(Code.UNAVAILABLE, "the guest broke") from e

        with pytest.raises(FeosError) as caught:
            await bridge.call(fail)
        assert caught.value.code is Code.UNAVAILABLE
        assert caught.value.__traceback__ is not None  # trio's own frames only
        assert isinstance(caught.value.__cause__, FeosError)
    assert where == ["capnp"]


async def test_cancelling_the_trio_wait_cancels_the_asyncio_task() -> None:
    async with capnp_thread() as bridge:
        cancelled = threading.Event()

        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with trio.move_on_after(0.2):
            await bridge.call(forever)
        await trio.to_thread.run_sync(cancelled.wait, 5)
        assert cancelled.is_set()


async def test_a_result_its_caller_left_is_closed() -> None:
    async with capnp_thread() as bridge:
        started, closed = threading.Event(), threading.Event()

        class Session:
            async def close(self) -> None:
                closed.set()

        async def stubborn() -> Session:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # ends with a result all the same, as a dial that connected just then
            return Session()

        with trio.move_on_after(0.2):
            await bridge.call(stubborn)
        assert started.is_set()
        assert await trio.to_thread.run_sync(closed.wait, 5)


async def test_to_trio_round_trip_and_errors() -> None:
    async with capnp_thread() as bridge:

        async def double(x: int) -> int:
            await trio.lowlevel.checkpoint()
            return 2 * x

        async def bad() -> None:
            raise FeosError(Code.INVALID_ARGUMENT, "x: must be even")

        async def on_asyncio() -> tuple[int, str]:
            value = await bridge.to_trio(double, 21)
            try:
                await bridge.to_trio(bad)
            except FeosError as exc:
                return value, str(exc)
            return value, ""

        assert await bridge.call(on_asyncio) == (42, "INVALID_ARGUMENT: x: must be even")


async def test_asyncio_side_cancel_cancels_the_trio_task() -> None:
    async with capnp_thread() as bridge:
        ended = trio.Event()

        async def slow() -> None:
            try:
                await trio.sleep_forever()
            finally:
                ended.set()

        async def on_asyncio() -> None:
            task = asyncio.ensure_future(bridge.to_trio(slow))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        await bridge.call(on_asyncio)
        with trio.fail_after(5):
            await ended.wait()


async def test_stop_with_calls_in_flight_answers_them() -> None:
    answers: list[str] = []
    held: list[CapnpThread] = []

    async def sleeper() -> None:
        await trio.sleep_forever()

    async with capnp_thread() as bridge:
        held.append(bridge)

        async def on_asyncio() -> None:
            try:
                await bridge.to_trio(sleeper)
            except FeosError as exc:
                answers.append(str(exc))

        future = asyncio.run_coroutine_threadsafe(on_asyncio(), bridge.loop)
        await trio.sleep(0.1)
    # The bridge has stopped: the handler heard why, and later calls are refused.
    await trio.to_thread.run_sync(lambda: future.exception(5))
    assert answers == ["UNAVAILABLE: feosd stops"]
    with pytest.raises(FeosError, match="feosd stops"):
        await held[0].call(asyncio.sleep, 0)


async def test_the_listeners_are_closed_on_the_capnp_thread_only() -> None:
    import socket

    from feos.rpc._server import close_listeners, listen

    async with capnp_thread() as bridge:
        a = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        a.bind(("127.0.0.1", 0))
        a.listen()
        server = await bridge.call(listen, a, lambda: None)
        with pytest.raises(RuntimeError, match="on the Cap'n Proto thread"):
            await close_listeners([server])  # from trio's thread: refused, left open
        assert a.fileno() != -1
        await bridge.call(close_listeners, [server])

        async def closed() -> bool:
            await server.wait_closed()
            return not server.is_serving()

        assert await bridge.call(closed)


class _Session:
    """A result with an async close(), as a guest's session and its socket."""

    def __init__(self, closed: threading.Event) -> None:
        self.closed = closed

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed.set()


async def test_a_result_posted_as_its_caller_is_cancelled_is_closed() -> None:
    """The result is there, but the caller's cancel reaches it before the wake-up does."""
    import time

    async with capnp_thread() as bridge:
        returned, closed = threading.Event(), threading.Event()

        async def quick() -> _Session:
            await asyncio.sleep(0.05)
            returned.set()
            return _Session(closed)

        async with trio.open_nursery() as n:
            scope, calling = trio.CancelScope(), trio.Event()

            async def caller() -> None:
                with scope:
                    calling.set()  # and on, with no checkpoint, to the wait in call()
                    await bridge.call(quick)
                    raise AssertionError("the caller was cancelled before it woke")

            n.start_soon(caller)
            await calling.wait()
            assert returned.wait(5)  # trio's thread is held: the wake-up waits behind the cancel
            time.sleep(0.1)  # noqa: ASYNC251 (held on purpose: the posted wake-up waits)
            scope.cancel()
        assert await trio.to_thread.run_sync(closed.wait, 5)


async def test_a_result_that_ends_the_step_before_the_cancel_is_closed() -> None:
    """The caller left, and the coroutine returned before its cancel reached the task."""
    async with capnp_thread() as bridge:
        started, go, closed = threading.Event(), threading.Event(), threading.Event()

        async def held() -> _Session:
            await asyncio.sleep(0)
            started.set()
            go.wait(5)  # the Cap'n Proto thread is held: the cancel waits behind this step
            return _Session(closed)

        async with trio.open_nursery() as n:
            scope = trio.CancelScope()

            async def caller() -> None:
                with scope:
                    await bridge.call(held)

            n.start_soon(caller)
            assert await trio.to_thread.run_sync(started.wait, 5)
            scope.cancel()
            await trio.sleep(0.05)  # the caller has left
            go.set()
        assert await trio.to_thread.run_sync(closed.wait, 5)


async def test_a_guest_dial_cancelled_at_any_point_leaves_no_socket(tmp_path: Path) -> None:
    """A real dial of a Unix socket that answers the hello, as QEMU's guest.sock does, cut at
    a sweep of moments; then the bridge stops. No socket is left to the collector."""
    import gc
    import socket
    import warnings

    from feos.guest import guest_hello
    from feos.guestlink import GuestClient

    path = str(tmp_path / "guest.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            with contextlib.suppress(OSError):  # the node's end went already
                conn.sendall(guest_hello("b00t", f"s{len(accepted)}"))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)  # an unclosed socket fails the test
            async with capnp_thread() as bridge, trio.open_nursery() as n:
                for i in range(60):
                    with trio.move_on_after(i * 0.0002):
                        client = await bridge.call(GuestClient.connect, path)
                        with trio.CancelScope(shield=True):  # as the guest link closes it
                            await bridge.call(client.close)

                async def session() -> None:  # as the guest link holds one
                    client = await bridge.call(GuestClient.connect, path)
                    try:
                        await trio.sleep_forever()
                    finally:
                        with trio.CancelScope(shield=True):
                            await bridge.call(client.close)

                for i in range(10):  # and sessions cut by the end of the service
                    n.start_soon(session)
                    await trio.sleep(i * 0.0002)
                n.cancel_scope.cancel()
            gc.collect()
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        server.join(5)
        for conn in accepted:
            conn.close()
