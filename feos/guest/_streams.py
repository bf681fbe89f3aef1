"""The stream capabilities the node pulls from: a log file, a pipe, and an exec'd process."""

from __future__ import annotations

import asyncio
import errno
import os

from feos.errors import Code, FeosError

from ._proc import Child, _set
from ._proto import fill_status, guest

TYPE_CHECKING = False  # typing costs the guest's start: for mypy only
if TYPE_CHECKING:
    from typing import Any

DEFAULT_READ = 65536
MAX_READ = 1 << 20
FOLLOW_POLL = 0.1


def _size(max_bytes: int) -> int:
    return min(max_bytes or DEFAULT_READ, MAX_READ)


async def _wait_fd(fd: int, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )
    add(fd, _set, fut)
    try:
        await fut
    finally:
        remove(fd)


class FileStream(guest.ByteStream.Server):  # type: ignore[misc]
    """A container's log from its start; with a container to follow, until that one stops."""

    def __init__(self, path: str, follow: Any) -> None:
        self.path = path
        self.follow = follow
        self.offset = 0

    async def read_context(self, ctx: Any) -> None:
        n = _size(int(ctx.params.maxBytes))
        while True:
            data = self._read(n)
            if data:
                ctx.results.data = data
                return
            if self.follow is None or self.follow.status != "running":
                if self.follow is not None:  # what it wrote last, before it stopped
                    data = self._read(n)
                    if data:
                        ctx.results.data = data
                        return
                ctx.results.eof = True
                return
            await asyncio.sleep(FOLLOW_POLL)

    def _read(self, n: int) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(n)
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data

    async def close_context(self, ctx: Any) -> None:
        self.follow = None


class PipeStream(guest.ByteStream.Server):  # type: ignore[misc]
    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd: int | None = fd

    async def read_context(self, ctx: Any) -> None:
        n = _size(int(ctx.params.maxBytes))
        while self.fd is not None:
            try:
                data = os.read(self.fd, n)
            except BlockingIOError:
                await _wait_fd(self.fd, write=False)
                continue
            except OSError as e:  # a terminal's master once the process's side has closed
                if e.errno != errno.EIO:
                    raise
                data = b""
            if data:
                ctx.results.data = data
                return
            self._close()
        ctx.results.eof = True

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    async def close_context(self, ctx: Any) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()


class ProcessServer(guest.Process.Server):  # type: ignore[misc]
    """An exec'd process. With a terminal, stdin is the terminal's master: closeStdin types the
    terminal's end of file (^D) into it, as a closed pipe would end a reader's input."""

    def __init__(self, child: Child, stdin: int | None, terminal: bool = False) -> None:
        self.child = child
        self.stdin = stdin
        self.terminal = terminal
        if stdin is not None:
            os.set_blocking(stdin, False)

    async def writeStdin_context(self, ctx: Any) -> None:
        view = memoryview(bytes(ctx.params.data))
        try:
            while view:
                if self.stdin is None:
                    raise FeosError(
                        Code.FAILED_PRECONDITION, "stdin is closed (or was not asked for)"
                    )
                try:
                    view = view[os.write(self.stdin, view) :]
                except BlockingIOError:
                    await _wait_fd(self.stdin, write=True)
                except BrokenPipeError:
                    raise FeosError(
                        Code.FAILED_PRECONDITION, "the process closed its stdin"
                    ) from None
        except FeosError as e:
            fill_status(ctx.results.status, e)

    async def closeStdin_context(self, ctx: Any) -> None:
        if self.stdin is not None:
            if self.terminal:
                try:
                    os.write(self.stdin, b"\x04")
                except OSError:
                    pass  # the process has gone, or its terminal's input is full: nothing waits
            os.close(self.stdin)
            self.stdin = None

    async def wait_context(self, ctx: Any) -> None:
        code = await asyncio.shield(self.child.exited)
        ctx.results.exitCode = code
        ctx.results.signal = code - 128 if code > 128 else 0

    async def kill_context(self, ctx: Any) -> None:
        sig = int(ctx.params.signal) or 15
        if not 1 <= sig <= 64:
            fill_status(ctx.results.status, FeosError(Code.INVALID_ARGUMENT, "signal: 1 to 64"))
            return
        self.child.signal(sig)

    def __del__(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
