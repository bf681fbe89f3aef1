"""Child processes of the agent: spawned with posix_spawn, reaped by one SIGCHLD handler.

As PID 1 the agent reaps every orphan (waitpid(-1)); outside (tests on the host) it waits only
for its own children, so that it takes no other's exit status. No child is ever waited for by
anything but the Reaper, which is why nothing here uses subprocess.Popen.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half, as signal.py uses it
import asyncio
import os
import signal
from collections.abc import Callable

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any


class Child:
    """A spawned process: its pid, its exit (the shell's code: 128 + signal when killed)."""

    def __init__(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.exited: asyncio.Future[int] = loop.create_future()

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    def signal(self, sig: int) -> None:
        if not self.exited.done():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def on_signal(sig: int, callback: Callable[..., object] | None, *args: Any) -> None:
    """loop.add_signal_handler(sig, callback, *args), or its removal when callback is None.

    Not asyncio's own: its check of the callback imports inspect, a cost at the guest's start
    (feos.guest._lean). Python runs a signal's handler on the main thread, the loop's: it hands
    the callback to the loop as asyncio's would. epoll_wait returns on a signal (EINTR) and
    Python retries it after the handler, by then woken by call_soon_threadsafe.
    """
    # _signal.signal, not signal.signal: that one turns the previous handler into an enum, and
    # when it is none (asyncio.run's SIGINT handler) the failed lookup reprs it, with the main
    # task and its callbacks: that repr imports inspect (80 ms at the guest's start).
    if callback is None:
        _signal.signal(
            sig, _signal.default_int_handler if sig == signal.SIGINT else _signal.SIG_DFL
        )
        return
    loop = asyncio.get_running_loop()
    _signal.signal(sig, lambda _sig, _frame: loop.call_soon_threadsafe(callback, *args))
    signal.siginterrupt(sig, False)  # SA_RESTART, as asyncio sets it


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Reaper:
    def __init__(self, *, all_orphans: bool) -> None:
        self.all_orphans = all_orphans
        self._children: dict[int, Child] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        on_signal(signal.SIGCHLD, self.reap)

    def uninstall(self) -> None:
        if self._loop is not None:
            on_signal(signal.SIGCHLD, None)

    def spawn(
        self,
        argv: list[str],
        *,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        env: dict[str, str] | None = None,
        setsid: bool = False,
        extra: tuple[int, ...] = (),
    ) -> Child:
        """Starts argv[0] from PATH with the given fds as its 0, 1, 2 (None: /dev/null) and
        the extra ones as its 3, 4, ..."""
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        # above every target first, so that no dup2 overwrites a source another one still needs
        high = [_dup_above(fd, 3 + len(extra)) for fd in extra]
        try:
            actions = [
                (os.POSIX_SPAWN_DUP2, null if fd is None else fd, target)
                for target, fd in enumerate((stdin, stdout, stderr, *high))
            ]
            pid = os.posix_spawnp(
                argv[0],
                argv,
                env if env is not None else _default_env(),
                file_actions=actions,
                setsid=setsid,
                setsigdef=(signal.SIGCHLD, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM),
            )
        finally:
            os.close(null)
            for fd in high:
                os.close(fd)
        child = Child(pid, asyncio.get_running_loop())
        self._children[pid] = child
        self.reap()  # it may have ended already, before it was known
        return child

    def reap(self) -> None:
        if self.all_orphans:
            self._reap_any()
        else:
            for pid in list(self._children):
                try:
                    got, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    got, status = pid, 0
                if got:
                    self._done(got, status)

    def _reap_any(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            self._done(pid, status)

    def _done(self, pid: int, status: int) -> None:
        child = self._children.pop(pid, None)
        if child is not None and not child.exited.done():
            child.exited.set_result(exit_code(status))


def _default_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }


async def read_fd(fd: int, limit: int = 1 << 20) -> bytes:
    """Everything a pipe gives until its end (at most limit bytes kept), then closes it."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    out = bytearray()
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(fd, _set, ready)
                try:
                    await ready
                finally:
                    loop.remove_reader(fd)
                continue
            if not chunk:
                return bytes(out)
            if len(out) < limit:
                out += chunk[: limit - len(out)]
    finally:
        os.close(fd)


def _set(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Failed(Exception):
    pass


async def run(
    reaper: Reaper, argv: list[str], *, input: bytes | None = None
) -> tuple[int, str, str]:
    """Runs a command to its end: (exit code, stdout, stderr)."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    in_r = in_w = None
    if input is not None:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
    try:
        child = reaper.spawn(argv, stdin=in_r, stdout=out_w, stderr=err_w)
    finally:
        for fd in (out_w, err_w, in_r):
            if fd is not None:
                os.close(fd)
    if in_w is not None:
        await asyncio.get_running_loop().run_in_executor(None, _write_all, in_w, input or b"")
    out, err, code = await asyncio.gather(read_fd(out_r), read_fd(err_r), child.exited)
    return code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _write_all(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def check(reaper: Reaper, argv: list[str]) -> str:
    """Runs a command; one that fails raises Failed naming it and its stderr."""
    code, out, err = await run(reaper, argv)
    if code:
        raise Failed(f"{' '.join(argv)} failed ({code}): {err.strip() or out.strip()}")
    return out


def _dup_above(fd: int, lowest: int) -> int:
    import fcntl  # only for a spawn with extra fds: not on the agent's start path

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
