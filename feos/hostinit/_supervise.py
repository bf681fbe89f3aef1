"""diskd and feosd, each started again a second after it ends, and every orphan reaped.

Theory of operation. PID 1 is every orphan's parent, so one SIGCHLD handler reaps all
(waitpid(-1)); a pid that is one of ours is that program's end, logged on the console with its
status and followed by a start a second later (a loop that crashes at once costs one start a
second, never a spinning CPU). feosd gets the resolver's sockets at fds 3 and 4, as systemd
hands them (LISTEN_FDS=2, LISTEN_FDNAMES=dns:dns, LISTEN_PID its own pid, which only the child
knows: a shell sets it and execs feosd). While the node stops, nothing starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence

import attrs

log = logging.getLogger("feos.hostinit")

RESTART_S = 1.0
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)
DNS_FDS = (3, 4)
_SET_PID = 'LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@"'


def bind_resolver_sockets(
    address: str = "169.254.0.53", port: int = 53
) -> tuple[socket.socket, socket.socket]:
    """The pods' resolver's UDP and listening TCP sockets, bound before the node holds the
    address (IP_FREEBIND), handed to every feosd. feos.net's bind_dns_sockets does the same,
    but importing feos.net costs PID 1 a second on the host, twenty under TCG."""
    socks = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        if kind == socket.SOCK_STREAM:
            s.listen(1024)
        socks.append(s)
    return socks[0], socks[1]


@attrs.define
class Program:
    name: str
    argv: Callable[[], list[str]]
    dns: bool = False  # hand it the resolver's sockets
    pid: int | None = None
    starts: int = 0


class Supervisor:
    def __init__(self, dns: Sequence[socket.socket] = ()) -> None:
        self._programs: dict[str, Program] = {}
        self._dns = list(dns)
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self.ended: dict[str, asyncio.Event] = {}

    def install(self) -> None:
        self._loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def add(self, program: Program) -> None:
        self._programs[program.name] = program
        self.ended[program.name] = asyncio.Event()
        self._start(program)

    def pid(self, name: str) -> int | None:
        p = self._programs.get(name)
        return None if p is None else p.pid

    def _start(self, p: Program) -> None:
        if self._stopping:
            return
        argv = p.argv()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
        actions: list[tuple[int, int, int]] = []
        if p.dns and self._dns:
            env.update(
                LISTEN_FDS=str(len(self._dns)), LISTEN_FDNAMES=":".join(["dns"] * len(self._dns))
            )
            actions = [
                (os.POSIX_SPAWN_DUP2, s.fileno(), fd)
                for s, fd in zip(self._dns, DNS_FDS, strict=False)
            ]
            argv = ["/bin/sh", "-c", _SET_PID, *argv]
        try:
            p.pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True)
        except OSError as exc:
            log.error("%s cannot start: %s; trying again in %.0f s", p.name, exc, RESTART_S)
            self._loop.call_later(RESTART_S, self._start, p)
            return
        p.starts += 1
        log.info("started %s (pid %d): %s", p.name, p.pid, " ".join(p.argv()))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for p in self._programs.values():
                if p.pid == pid:
                    self._ended(p, status)

    def _ended(self, p: Program, status: int) -> None:
        p.pid = None
        how = (
            f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            if os.WIFSIGNALED(status)
            else f"exit code {os.waitstatus_to_exitcode(status)}"
        )
        self.ended[p.name].set()
        self.ended[p.name] = asyncio.Event()
        if self._stopping:
            log.info("%s ended (%s)", p.name, how)
            return
        log.warning("%s ended (%s): starting it again in %.0f s", p.name, how, RESTART_S)
        self._loop.call_later(RESTART_S, self._start, p)

    def restart(self, name: str) -> None:
        """End a program so that it starts again (with new arguments: a new pod prefix)."""
        p = self._programs[name]
        if p.pid is not None:
            os.kill(p.pid, signal.SIGTERM)

    async def stop(self, grace: float) -> None:
        """SIGTERM to ours, up to `grace` for them to end, then, as PID 1 only, SIGTERM and
        SIGKILL to every process left (the pods' VMMs)."""
        self._stopping = True
        for p in self._programs.values():
            if p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = self._loop.time() + grace
        for p in self._programs.values():
            if p.pid is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ended[p.name].wait(), deadline - self._loop.time())
        if os.getpid() == 1:  # kill(-1) outside PID 1's namespace would signal the whole machine
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.kill(-1, sig)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.5)
        else:
            for p in self._programs.values():
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
        self.reap()
