"""The bridge between trio, where feosd runs, and pycapnp, which runs only on asyncio.

Theory of operation: pycapnp's RPC needs asyncio with its KJ loop (`capnp.run`). feosd runs one
OS thread for it, the Cap'n Proto thread, for its whole life. Two directions cross it:

- trio -> asyncio: `CapnpThread.call(fn, *args)` runs the coroutine `fn(*args)` on the Cap'n Proto
  thread and waits for it in trio. Cancelling the trio wait cancels the asyncio task.
- asyncio -> trio: `CapnpThread.to_trio(fn, *args)`, awaited on the Cap'n Proto thread (by an RPC
  handler), runs the trio function `fn(*args)` as a task of the bridge's nursery and resolves when
  it ends. A handler cancelled on the asyncio side (its connection dropped) cancels the trio task;
  a trio task cut by feosd's stop answers UNAVAILABLE "feosd stops".

Only plain Python values cross: Cap'n Proto readers and builders stay on their thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import capnp
import trio

from ..errors import Code, FeosError

T = TypeVar("T")
log = logging.getLogger("feos.rpc")

STOPPING = "feosd stops"


class CapnpThread:
    """pycapnp's asyncio loop on a thread of its own; made by `capnp_thread()`."""

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self._token = token
        self._nursery = nursery
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()  # orphans' closes (Cap'n Proto thread)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the Cap'n Proto thread is not running"
        return self._loop

    async def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run the asyncio coroutine fn(*args) on the Cap'n Proto thread; wait for it in trio.

        A caller that leaves (cancelled) cancels the task, and what the task still returns is
        nobody's: it is closed on the Cap'n Proto thread (see `_Call`)."""
        if self._closed:
            raise FeosError(Code.UNAVAILABLE, STOPPING)
        done = trio.Event()
        call: _Call[T] = _Call(fn, args, lambda: self._wake(done), self._orphan)
        try:
            self.loop.call_soon_threadsafe(call.start)
        except RuntimeError:  # the loop has closed
            raise FeosError(Code.UNAVAILABLE, STOPPING) from None
        try:
            await done.wait()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # a closed loop has closed what it held
                self.loop.call_soon_threadsafe(call.leave)
            raise
        try:
            return call.outcome.result()
        except concurrent.futures.CancelledError:
            raise FeosError(Code.UNAVAILABLE, STOPPING) from None

    def _orphan(self, result: Any) -> None:
        """On the Cap'n Proto thread: a result whose caller left; one with an async close() (a
        guest's session and its socket) is closed in a task the loop's stop waits for."""
        close = getattr(result, "close", None)
        if close is None or not asyncio.iscoroutinefunction(close):
            return
        task = asyncio.ensure_future(_close_quietly(close))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def to_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """On the Cap'n Proto thread: run the trio function fn(*args) and wait for its end."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()
        try:
            self._token.run_sync_soon(self._nursery.start_soon, self._run, scope, fn, args, future)
        except trio.RunFinishedError:
            raise FeosError(Code.UNAVAILABLE, STOPPING) from None
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel_soon(scope)
            raise

    async def _run(
        self,
        scope: trio.CancelScope,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        future: asyncio.Future[T],
    ) -> None:
        outcome: tuple[bool, Any] = (False, FeosError(Code.UNAVAILABLE, STOPPING))
        try:
            with scope:
                try:
                    outcome = (True, await fn(*args))
                except Exception as exc:  # delivered to the RPC handler, which answers it
                    outcome = (False, exc)
        finally:
            self._settle(future, outcome)

    def _settle(self, future: asyncio.Future[T], outcome: tuple[bool, Any]) -> None:
        def settle() -> None:
            if future.done():
                return
            ok, value = outcome
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def _wake(self, event: trio.Event) -> None:
        try:
            self._token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    def _cancel_soon(self, scope: trio.CancelScope) -> None:
        try:
            self._token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            pass

    # -- the thread ------------------------------------------------------------------------

    def _main(self, started: trio.Event) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._wake(started)
            await self._stop.wait()
            log.debug("the Cap'n Proto thread stops: %d tasks left", len(asyncio.all_tasks()))
            # The tasks left are cancelled; what their callers left behind is closed, also
            # what they return as they end (a close is not cancelled: it closes sockets).
            while tasks := [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                for task in tasks:
                    if task not in self._closing:
                        task.cancel()
                await asyncio.wait(tasks)
            log.debug("the Cap'n Proto thread's tasks have ended")

        asyncio.run(capnp.run(main()))
        log.debug("the Cap'n Proto thread's loop has ended")

    async def _start(self) -> None:
        started = trio.Event()
        self._thread = threading.Thread(
            target=self._main, args=(started,), name="capnp", daemon=True
        )
        self._thread.start()
        await started.wait()

    async def _close(self) -> None:
        self._closed = True
        if self._loop is not None and self._stop is not None:
            stop = self._stop
            try:
                self._loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            await trio.to_thread.run_sync(self._thread.join)
            log.debug("the Cap'n Proto thread has ended")


async def _scrubbed(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """fn(*args)'s result (the coroutine is made here: one cancelled before it ran is never
    made, rather than left never awaited); what it raises leaves without the locals of its frames.

    Those hold Cap'n Proto readers and clients, which must be freed on this thread: freed on
    trio's (by the cyclic GC, say, once the exception is part of a cycle there) they abort the
    process ("No event loop is running on this thread", from KJ). So each frame of the
    exception's traceback, and of those it chains, is cleared here, and the one raised carries
    no traceback of this thread: its message says what failed.
    """
    try:
        result = await fn(*args)
    except BaseException as e:
        seen: set[int] = set()
        link: BaseException | None = e
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            traceback.clear_frames(link.__traceback__)
            link = link.__cause__ or link.__context__
        e.with_traceback(None)
        raise
    return result


CLOSE_S = 5.0


async def _close_quietly(close: Callable[[], Awaitable[Any]]) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_S):
            await close()


class _Call(Generic[T]):
    """One `CapnpThread.call`: its task on the Cap'n Proto thread, and who owns its result.

    The caller owns what the task returns until it leaves (cancelled); after that the Cap'n
    Proto thread does. Both the end of the task and the caller's leaving are handled on that
    thread, in whichever order they come, so a result is either posted to a caller that reads
    it or handed to `orphan` exactly once: never dropped as asyncio drops what a cancelled
    future would have held (a dial that connected just as its caller went, say).
    """

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, T]],
        args: tuple[Any, ...],
        wake: Callable[[], None],
        orphan: Callable[[Any], None],
    ) -> None:
        self._fn, self._args = fn, args
        self.outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._wake = wake
        self._orphan = orphan
        self._task: asyncio.Task[T] | None = None
        self._returned: list[T] = []  # what the coroutine returned, also if asyncio drops it
        self._left = False
        self._posted = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(self._ended)

    async def _run(self) -> T:
        result = await _scrubbed(self._fn, *self._args)
        self._returned.append(result)
        return result

    def _ended(self, task: asyncio.Task[T]) -> None:
        self._task = None  # freed here, with what it holds
        returned, self._returned = self._returned, []
        if task.cancelled():
            # A cancel that came as the coroutine returned cancels the task all the same, and
            # asyncio drops the result: nobody's then (the caller hears "feosd stops").
            for result in returned:
                self._orphan(result)
            self.outcome.cancel()
        elif (exc := task.exception()) is not None:
            self.outcome.set_exception(exc)
        elif self._left:
            self._orphan(task.result())
            return
        else:
            self.outcome.set_result(task.result())
        self._posted = True
        self._wake()

    def leave(self) -> None:
        """The caller went without reading the outcome."""
        self._left = True
        if self._task is not None:
            self._task.cancel()  # what it still returns comes to _ended
        elif self._posted and not self.outcome.cancelled() and self.outcome.exception() is None:
            self._orphan(self.outcome.result())


@asynccontextmanager
async def capnp_thread() -> AsyncIterator[CapnpThread]:
    """Run the Cap'n Proto thread for the body's duration; its handlers' trio tasks live here.

    On exit the trio tasks still running are cancelled and their callers hear "feosd stops";
    only then does the asyncio loop end its own tasks and the thread is joined.
    """
    threads: list[CapnpThread] = []
    try:
        async with trio.open_nursery() as tasks:
            threads.append(CapnpThread(trio.lowlevel.current_trio_token(), tasks))
            await threads[0]._start()
            try:
                yield threads[0]
            finally:
                tasks.cancel_scope.cancel()
    finally:
        # Every trio task has ended and posted its answer before the loop is told to stop.
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            for thread in threads:
                await thread._close()
