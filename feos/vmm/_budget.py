"""The suspend's budget: how long a SuspendPod may take, from the microVM's memory alone.

One formula, so that the suspend's own timeouts and its callers' deadlines agree (node.md, "The
suspend's budget"): a part before the snapshot, the snapshot, which grows with the memory at a
disk's 256 MiB/s, and a part after it, which grows with the zeroes punched out of the memory file.
"""

from __future__ import annotations

import attrs

_GIB = 1 << 30

BEFORE_S = 40
"""The guest empties its memory, free page reporting settles, the API pauses, the directory."""
SNAPSHOT_BASE_S = 120
SNAPSHOT_PER_GIB_S = 4
AFTER_BASE_S = 30
AFTER_PER_GIB_S = 1


@attrs.frozen
class SuspendBudget:
    """The parts of one suspend's budget, in whole seconds."""

    gib: int
    before_s: int
    snapshot_s: int
    after_s: int

    @property
    def total_s(self) -> int:
        return self.before_s + self.snapshot_s + self.after_s


def gib_of(memory_bytes: int) -> int:
    """The memory in GiB, rounded up: a microVM of 1 GiB and a byte counts 2."""
    if memory_bytes < 0:
        raise ValueError("memory cannot be negative")
    return -(-memory_bytes // _GIB)


def suspend_budget(memory_bytes: int) -> SuspendBudget:
    """The budget of suspending a microVM of this much memory."""
    gib = gib_of(memory_bytes)
    return SuspendBudget(
        gib=gib,
        before_s=BEFORE_S,
        snapshot_s=SNAPSHOT_BASE_S + SNAPSHOT_PER_GIB_S * gib,
        after_s=AFTER_BASE_S + AFTER_PER_GIB_S * gib,
    )


def suspend_budget_mib(memory_mib: int) -> SuspendBudget:
    """The same for a memory size given in MiB, as a pod's spec gives it."""
    return suspend_budget(memory_mib << 20)
