"""ExecInPod's and PodLogs' ByteStreams: relays from the guest's streams, on the RPC thread.

These run on the Cap'n Proto thread (asyncio) from end to end: the guest's streams are
capabilities there, and the caller's pulls arrive there, so the bytes never cross to trio. Two
pumps read the guest's stdout and stderr into one queue; `read` hands out what is there (waiting
for something), and once both have ended and the process has exited, its exit code.

The relay owns its pumps. They end with the guest's streams, or when the caller lets go of the
ByteStream (it hangs up, or its connection drops): rpc's `serve` then calls `released`, which
cancels them and lets go of the guest's capabilities, so the guest ends its side (a followed
log stops being read, the process's stdin closes). The Cap'n Proto thread's end cancels them
too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import Code, FeosError
from ..rpc import on_rpc_thread

CHUNK = 64 * 1024


class Relay:
    def __init__(self, stdout: Any, stderr: Any, process: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=64)
        self._process = process
        self._open = 2
        self._exit: int | None = None
        self._error: FeosError | None = None
        self._tasks = {self._loop.create_task(self._pump("stdout", stdout)),
                       self._loop.create_task(self._pump("stderr", stderr))}
        for task in self._tasks:
            task.add_done_callback(self._tasks.discard)

    @property
    def pumps(self) -> frozenset[asyncio.Task[None]]:
        """Its pumps that still run."""
        return frozenset(self._tasks)

    async def _pump(self, which: str, reader: Any) -> None:
        try:
            async for chunk in reader:
                await self._queue.put((which, chunk))
        except FeosError as exc:
            self._error = exc
        await self._queue.put((which, b""))  # not when cancelled: nobody reads any more

    def released(self) -> None:
        """The caller has let go of the stream (from a finalizer, on any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._end)
        except RuntimeError:  # the loop has closed, and its tasks with it
            pass

    def _end(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._process = None  # the guest's Process: released, its stdin closes

    async def _finish(self) -> None:
        if self._process is None:
            self._exit = 0
            return
        code, signal = await self._process.wait()
        self._exit = code if not signal else 128 + signal

    @on_rpc_thread
    async def read(self, params: dict[str, Any]) -> dict[str, Any]:
        out, err = bytearray(), bytearray()
        while not out and not err and self._open:
            which, chunk = await self._queue.get()
            self._take(which, chunk, out, err)
        while not self._queue.empty() and len(out) + len(err) < CHUNK:
            self._take(*self._queue.get_nowait(), out, err)
        answer: dict[str, Any] = {"stdout": bytes(out), "stderr": bytes(err)}
        if not self._open and self._queue.empty() and not out and not err:
            if self._error is not None:
                raise self._error
            if self._exit is None:
                await self._finish()
            answer.update(exited=True, exitCode=self._exit)
        return answer

    def _take(self, which: str, chunk: bytes, out: bytearray, err: bytearray) -> None:
        if not chunk:
            self._open -= 1
        (out if which == "stdout" else err).extend(chunk)

    @on_rpc_thread
    async def write(self, params: dict[str, Any]) -> dict[str, Any]:
        if self._process is None:
            raise FeosError(Code.FAILED_PRECONDITION, "logs have no input")
        data = params.get("data", b"")
        if data:
            await self._process.write_stdin(data)
        if params.get("close", False):
            await self._process.close_stdin()
        return {}


async def open_exec(client: Any, container: str, command: list[str], env: list[str],
                    tty: bool = False, working_dir: str = "", rows: int = 0,
                    cols: int = 0) -> Relay:  # fmt: skip
    """tty, working_dir, rows, cols: GuestClient.exec's, passed through (positional too: the
    guest handle's call takes no keywords)."""
    process = await client.exec(container, command, env, stdin=True, tty=tty,
                                working_dir=working_dir, rows=rows, cols=cols)  # fmt: skip
    return Relay(process.stdout, process.stderr, process)


async def open_logs(client: Any, container: str, follow: bool) -> Relay:
    stdout = await client.logs(container, "stdout", follow=follow)
    stderr = await client.logs(container, "stderr", follow=follow)
    return Relay(stdout, stderr)
