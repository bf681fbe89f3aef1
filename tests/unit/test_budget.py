"""The suspend's budget holds the spec's table, the same one ferund's tests hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.vmm._budget import gib_of, suspend_budget, suspend_budget_mib

GIB = 1 << 30


@pytest.mark.parametrize(
    ("memory", "gib", "snapshot", "after", "total"),
    [
        (0, 0, 120, 30, 190),
        (1, 1, 124, 31, 195),
        (512 << 20, 1, 124, 31, 195),
        (GIB, 1, 124, 31, 195),
        (GIB + 1, 2, 128, 32, 200),
        (4 * GIB, 4, 136, 34, 210),
        (16 * GIB, 16, 184, 46, 270),
        (64 * GIB, 64, 376, 94, 510),
    ],
)
def test_table(memory: int, gib: int, snapshot: int, after: int, total: int) -> None:
    b = suspend_budget(memory)
    got = (b.gib, b.before_s, b.snapshot_s, b.after_s, b.total_s)
    assert got == (gib, 40, snapshot, after, total)


def test_mib_rounds_up_like_bytes() -> None:
    assert suspend_budget_mib(1025) == suspend_budget(2 * GIB)
    assert suspend_budget_mib(1024).gib == 1


@given(st.integers(min_value=0, max_value=1 << 44))
def test_total_is_190_plus_5_per_gib(memory: int) -> None:
    b = suspend_budget(memory)
    assert b.total_s == 190 + 5 * gib_of(memory)
    assert (b.gib - 1) * GIB < memory <= b.gib * GIB or memory == b.gib == 0


def test_negative_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        suspend_budget(-1)
