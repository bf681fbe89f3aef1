"""feosd's reaper: the orphans re-parented to feosd, its subreaper, are reaped; nothing else is.

Theory of operation. feosd is the subreaper of its children (PR_SET_CHILD_SUBREAPER), so a
process whose parent ends below feosd becomes feosd's child, and nobody in feosd waits for it:
without a reaper it stays a zombie. But most children of feosd do have a waiter of their own
(subprocess.run on a worker thread, a trio.Process, a VMM driver's pidfd), and a reaper that
calls waitpid(-1) would take their exit status from them (subprocess then reads 0 for a failed
mkfs). So the reaper looks before it reaps:

- On each SIGCHLD (and once at its start) `waitid(P_ALL, WEXITED | WNOHANG | WNOWAIT)` says
  whether any child has ended, without reaping it.
- The kernel hands an orphan to the subreaper's first living thread, its main thread (trio's),
  while a child spawned on a worker thread stays that thread's child until the thread ends. So
  only the main thread's children are candidates (/proc/self/task/<pid>/children), each looked
  at alone (waitid with WNOWAIT again); the ones that ended are reaped unless claimed.
- A child that outlives the worker thread that spawned it (a microVM's VMM: trio's thread cache
  ends idle threads) moves to the main thread too: its driver claims it (`claim(pid)`) right
  after the spawn, and releases it once it has read its status. Claims of processes that are no
  longer feosd's children are dropped at each pass, so a reused pid is not protected by mistake.

A synchronous spawn on the main thread itself waits before trio runs again, so the reaper never
sees it. feosd runs the reaper as a task (`run`); `REAPER` is the one instance the drivers claim
their children with.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

log = logging.getLogger("feos.reaper")

_PEEK = os.WEXITED | os.WNOHANG | os.WNOWAIT


@attrs.frozen
class Reaped:
    """An orphan the reaper reaped, and how it ended (the code, or 128 + the signal)."""

    pid: int
    status: int


def _children(tid: int) -> set[int]:
    try:
        text = Path(f"/proc/self/task/{tid}/children").read_text()
    except OSError:
        return set()
    return {int(p) for p in text.split()}


def _all_children() -> set[int]:
    found: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        found |= _children(int(tid))
    return found


def _ended(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, _PEEK) is not None
    except ChildProcessError:  # reaped meanwhile by its own waiter
        return False


def _reap(pid: int) -> Reaped | None:
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        return None
    if info is None:
        return None
    exited = info.si_code == os.CLD_EXITED
    return Reaped(pid, info.si_status if exited else 128 + info.si_status)


class Reaper:
    """Reaps the orphans; leaves the children of worker threads and the claimed ones alone."""

    def __init__(self, on_reaped: Callable[[Reaped], None] | None = None) -> None:
        self._claimed: set[int] = set()
        self._lock = threading.Lock()  # claims come from worker threads too
        self._on_reaped = on_reaped

    def claim(self, pid: int) -> None:
        """`pid`, a child of feosd, has a waiter of its own: never reap it."""
        with self._lock:
            self._claimed.add(pid)

    def release(self, pid: int) -> None:
        with self._lock:
            self._claimed.discard(pid)

    def reap(self) -> list[Reaped]:
        """One pass: reap the main thread's children that ended and nobody claimed."""
        try:
            if os.waitid(os.P_ALL, 0, _PEEK) is None:
                return []
        except ChildProcessError:  # no children at all
            return []
        with self._lock:
            self._claimed &= _all_children()
            claimed = set(self._claimed)
        candidates = _children(os.getpid()) - claimed
        reaped = [r for pid in sorted(candidates) if _ended(pid) and (r := _reap(pid))]
        for r in reaped:
            log.debug("reaped orphan %d (status %d)", r.pid, r.status)
            if self._on_reaped is not None:
                self._on_reaped(r)
        return reaped

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reap at the start and at each SIGCHLD, until cancelled."""
        with trio.open_signal_receiver(signal.SIGCHLD) as signals:
            self.reap()
            task_status.started()
            async for _ in signals:
                self.reap()


REAPER = Reaper()
