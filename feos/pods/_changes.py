"""The pod changes' runner: each change a task of the pod service's nursery, shielded, with a
deadline, under its pod's lock.

Theory of operation. A change (create's record, the bring-up, start, stop, delete, suspend,
resume) is submitted by its call and runs as a task of `Changes`' nursery, never the caller's: a
caller that goes away (its deadline, a reset, the node's stop) cancels only its own wait on
`done`, and the change runs to its end. The task is two scopes:

- the shield: no outer cancel reaches the change. Its deadline is the lock's wait, the change's
  own deadline and RECORD_S after both (the record of a bring-up that ran out of time), so the
  shield always has a timeout inside it. Only the node's stop cancels it, once --stop-grace is
  over (`finish`).
- the change's own scope, inside the shield: it waits for the pod's lock (up to `lock_wait_s`),
  then has `deadline_s` to do its work. `end()` cancels it explicitly: a stop or a delete ends a
  bring-up so. A change that runs out of its time answers DEADLINE_EXCEEDED (a bring-up records
  FAILED first, through its `on_timeout`).

The node's stop is `refuse()`, then `finish(within)`: new changes are refused with UNAVAILABLE
"feosd stops", those in flight run on to their ends within the grace, and only the ones still
running then are cancelled (their callers hear UNAVAILABLE "feosd stops"). The node's own
changes (the suspends of --suspend-on-stop, the bring-ups of a take-over) pass the refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import attrs
import trio

from ..disk import WAIT_S as DISKD_WAIT_S  # how long a change that needs a disk waits for diskd
from ..errors import Code, FeosError
from ..vmm import suspend_budget_mib
from ._pod import Pod

log = logging.getLogger(__name__)

T = TypeVar("T")

STOPPING = "feosd stops"

# -- the deadlines (docs/pods.md, "Changes and their deadlines") --------------------------------

RECORD_S = 30.0
"""One record write: an fsync can take seconds behind the write-back of a snapshot's memory."""
CREATE_S = 60.0
"""Create's part before its answer: the volumes claimed, the addresses, the first record."""
DISK_S = DISKD_WAIT_S + 60.0
"""The pod's disks from diskd: the guest's blank data volume imported once per guest version,
the disk made (no copy) and started."""
VOLUMES_S = 60.0
"""The guest formats (first boot) and mounts the pod's volumes."""
PULLS_S = 300.0
"""The containers made and started: their images pulled into the guest, unpacked."""
START_S = RECORD_S
"""A start records the pod PENDING; its bring-up is a change of its own."""
SHUTDOWN_GRACE_S = 30.0
"""A stop asks the guest to shut down, and waits this long before the microVM is removed."""
REMOVAL_S = 30.0
"""The microVM removed: its VMM killed, its directory and cgroup gone."""
STOP_S = SHUTDOWN_GRACE_S + REMOVAL_S + RECORD_S
DELETE_S = REMOVAL_S + 30.0 + 3 * RECORD_S
"""The microVM, the network (TAP, table, conntrack) and the disk removed, the volumes released,
the record removed."""
RESUME_S = 90.0 + DISKD_WAIT_S
"""The disks started (diskd waited for, up to two minutes), the link made, the VMM loads the
snapshot (30 s), the guest answers its ping (30 s), the record."""


def bring_up_s(attach_s: float) -> float:
    """A bring-up: the disk, the microVM and its attach, the volumes, the pulls, RUNNING kept."""
    return DISK_S + attach_s + VOLUMES_S + PULLS_S + RECORD_S


def suspend_s(memory_mib: int) -> float:
    """A suspend answers within its budget (feos.vmm's suspend_budget), its record after it."""
    return suspend_budget_mib(memory_mib).total_s + RECORD_S


def lock_wait_s(memory_mib: int, attach_s: float) -> float:
    """How long a change waits for its pod's lock: the longest change another may run."""
    return max(bring_up_s(attach_s), suspend_s(memory_mib), STOP_S, DELETE_S, RESUME_S)


async def bounded_write(fn: Callable[[], Awaitable[T]], what: str, within: float = RECORD_S) -> T:
    """A record write that no cancel cuts halfway and that fails its call once `within` passed,
    UNAVAILABLE naming what was not written (the write itself may still land after)."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + within):
        return await fn()
    raise FeosError(Code.UNAVAILABLE, f"{what} was not written within {within:g}s")


# -- one change -------------------------------------------------------------------------------


@attrs.define(eq=False)
class Change(Generic[T]):
    """A submitted change; its caller awaits `result()`, a stop may `end()` it."""

    pod: Pod
    what: str
    deadline_s: float
    lock_wait_s: float
    fn: Callable[[Pod], Awaitable[T]]
    acts: Callable[[Pod], bool]  # is the pod still the one it was asked for
    before: Callable[[], Awaitable[None]] | None = None  # before the lock: end a bring-up
    on_timeout: Callable[[Pod], Awaitable[None]] | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    shield: trio.CancelScope = attrs.field(factory=lambda: trio.CancelScope(shield=True))
    done: trio.Event = attrs.field(factory=trio.Event)
    ended: str = ""
    finished: bool = False
    value: T | None = None
    error: BaseException | None = None

    def end(self, why: str) -> None:
        """Cancel the change's own scope (not its shield): it ends where it is."""
        self.ended = why
        self.scope.cancel()

    async def result(self) -> T:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

    def cut(self) -> None:
        """The node's stop, past its grace: cancel the shield itself."""
        self.ended = STOPPING
        self.shield.cancel()

    async def run(self) -> None:
        with self.shield:
            self.shield.deadline = (trio.current_time() + self.lock_wait_s + self.deadline_s
                                    + RECORD_S)
            try:
                self.value = await self._in_scope()
                self.finished = True
            except Exception as exc:  # handed to the caller
                self.error = exc
            finally:
                self.done.set()
        if self.shield.cancelled_caught and self.error is None and not self.finished:
            self.error = (FeosError(Code.UNAVAILABLE, STOPPING) if self.ended == STOPPING
                          else self._late())

    async def _in_scope(self) -> T:
        locked = False
        try:
            with self.scope:
                with trio.move_on_after(self.lock_wait_s) as waited:
                    if self.before is not None:
                        await self.before()
                    await self.pod.lock.acquire()
                    locked = True
                if waited.cancelled_caught:
                    raise FeosError(Code.ABORTED, f"pod {self.pod.id}: another change held "
                                                  f"it for {self.lock_wait_s:g}s")
                if not self.acts(self.pod):
                    raise FeosError(Code.NOT_FOUND, f"pod {self.pod.id} does not exist")
                self.scope.deadline = trio.current_time() + self.deadline_s
                return await self.fn(self.pod)
            # the scope caught its own cancel: its deadline passed, or end() ended it
            if locked and not self.ended and self.on_timeout is not None:
                await self.on_timeout(self.pod)
            raise self._late()
        finally:
            if locked:
                self.pod.lock.release()

    def _late(self) -> FeosError:
        if self.ended:
            return FeosError(Code.ABORTED, f"pod {self.pod.id}: its {self.what} was ended: "
                                           f"{self.ended}")
        return FeosError(Code.DEADLINE_EXCEEDED, f"pod {self.pod.id}: its {self.what} did not "
                                                 f"end within {self.deadline_s:g}s")


# -- the runner -------------------------------------------------------------------------------


class Changes:
    """The pod service's changes in flight, and the node's stop of them."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self.stopping = False
        self._changes: set[Change[Any]] = set()
        self._idle = trio.Event()
        self._idle.set()

    def open(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def in_flight(self) -> int:
        return len(self._changes)

    def check(self) -> None:
        """UNAVAILABLE "feosd stops" once the node's stop began."""
        if self.stopping:
            raise FeosError(Code.UNAVAILABLE, STOPPING)

    def submit(self, change: Change[T], *, node: bool = False) -> Change[T]:
        """Run the change in the service's nursery; `node`: one of the node's own, which the
        stop does not refuse."""
        if not node:
            self.check()
        assert self._nursery is not None, "the pod service does not run"
        if not self._changes:
            self._idle = trio.Event()
        self._changes.add(change)
        self._nursery.start_soon(self._run, change)
        return change

    async def _run(self, change: Change[Any]) -> None:
        try:
            await change.run()
        finally:
            self._changes.discard(change)
            if not self._changes:
                self._idle.set()

    def refuse(self) -> None:
        self.stopping = True

    async def wait_idle(self) -> None:
        while self._changes:
            await self._idle.wait()

    async def finish(self, within: float) -> None:
        """The node's stop: refuse new changes, let those in flight end within `within`, then
        cancel what is left (each change's shield), and wait for the cancelled to end."""
        self.refuse()
        with trio.move_on_after(within):
            await self.wait_idle()
        left = list(self._changes)
        if left:
            log.warning("the stop's grace is over: %s cut", ", ".join(
                f"pod {c.pod.id}'s {c.what}" for c in left))
            for change in left:
                change.cut()
        with trio.move_on_after(RECORD_S):  # a write in flight has its own bound
            await self.wait_idle()
