"""diskd and feosd, each started again a second after it ends, and every orphan reaped.

Theory of operation. PID 1 is every orphan's parent, so one SIGCHLD handler reaps all
(waitpid(-1)); a pid that is one of ours is that program's end, logged on the console with its
status and followed by a start a second later (a loop that crashes at once costs one start a
second, never a spinning CPU). feosd gets the resolver's sockets at fds 3 and 4, as systemd
hands them (LISTEN_FDS=2, LISTEN_FDNAMES=dns:dns, LISTEN_PID its own pid, which only the child
knows: a shell sets it and execs feosd). While the node stops, nothing starts again.

Their output (stdout and stderr, of every start and of their children) goes into one pipe per
program that host-init keeps for the node's life; a thread reads it line by line and writes each
line as a record of its own (`feosd: ...`) to `output`, /dev/kmsg on the node. The console then
has one writer, the kernel's printk, whose records no other writer splits: host-init's lines and
the programs' reach it whole and in order. A program that writes faster than the console prints
waits on its full pipe; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence

import attrs

from ._plan import LINE_MAX, program_records

log = logging.getLogger("feos.hostinit")

RESTART_S = 1.0
DNS_FDS = (3, 4)
_SET_PID = 'LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@"'


@attrs.define
class Program:
    name: str
    argv: Callable[[], list[str]]
    dns: bool = False  # hand it the resolver's sockets
    pid: int | None = None
    starts: int = 0
    out: int | None = None  # the write end of its output's pipe, kept for the node's life


def _relay(fd: int, name: str, output: Callable[[bytes], None]) -> None:
    """A program's output, line by line, to `output` as records, for the node's life (the write
    end stays open in host-init: the pipe never ends)."""
    with os.fdopen(fd, "rb") as pipe:
        while line := pipe.readline(4 * LINE_MAX):
            for record in program_records(name, line):
                try:
                    output(record)
                except OSError as exc:
                    log.error("%s's output: a line lost: %s", name, exc)


class Supervisor:
    """`output` takes the programs' lines as records (_plan.program_records); None: they write
    to host-init's own stdout and stderr."""

    def __init__(
        self, dns: Sequence[socket.socket] = (), output: Callable[[bytes], None] | None = None
    ) -> None:
        self._programs: dict[str, Program] = {}
        self._dns = list(dns)
        self._output = output
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self.ended: dict[str, asyncio.Event] = {}

    def install(self) -> None:
        self._loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def add(self, program: Program) -> None:
        self._programs[program.name] = program
        self.ended[program.name] = asyncio.Event()
        if self._output is not None and program.out is None:
            read, program.out = os.pipe()
            relay = threading.Thread(target=_relay, args=(read, program.name, self._output),
                                     name=f"output of {program.name}", daemon=True)
            relay.start()
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
        if p.out is not None:  # before the sockets' dup2s, which may take the pipe's fd number
            actions += [(os.POSIX_SPAWN_DUP2, p.out, 1), (os.POSIX_SPAWN_DUP2, p.out, 2)]
        if p.dns and self._dns:
            env.update(
                LISTEN_FDS=str(len(self._dns)), LISTEN_FDNAMES=":".join(["dns"] * len(self._dns))
            )
            actions += [
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
