"""The guest's clock: the measurement's arithmetic, and the loop's decisions on trio's autojump
clock against a guest that keeps a clock of its own."""

from __future__ import annotations

import time
from typing import Any

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.vmm._guestlink import (
    GuestLink,
    Measurement,
    Sample,
    correction,
    measure,
    needs_set_time,
    offset_of,
)  # fmt: skip


def test_offset_is_guest_minus_the_middle() -> None:
    s = Sample(real_before_ns=1_000_000, guest_ns=1_600_000, round_trip_ns=400_000)
    assert offset_of(s) == 400_000  # the middle is 1_200_000


def test_shortest_round_trip_wins() -> None:
    samples = [Sample(0, 5_000, 8_000), Sample(100, 1_100, 2_000), Sample(0, 9, 3_000)]
    assert measure(samples) == Measurement(0, 2_000)


def test_dropped_above_10ms_and_without_samples() -> None:
    assert measure([Sample(0, 0, 10_000_001), Sample(0, 0, 20_000_000)]) is None
    assert measure([]) is None
    assert measure([Sample(0, 0, 10_000_000)]) == Measurement(-5_000_000, 10_000_000)


def test_correction_and_set_time() -> None:
    ahead = Measurement(30_000_000, 1000)
    assert correction(ahead) == -30_000_000  # the guest is ahead: it moves back
    assert needs_set_time(ahead)
    assert not needs_set_time(Measurement(-20_000_000, 1000))
    assert needs_set_time(Measurement(-20_000_001, 1000))


@given(st.lists(st.tuples(st.integers(0, 1 << 62), st.integers(0, 1 << 62),
                          st.integers(0, 50_000_000)), min_size=1, max_size=8))  # fmt: skip
def test_measure_picks_the_shortest(raw: list[tuple[int, int, int]]) -> None:
    samples = [Sample(*r) for r in raw]
    m = measure(samples)
    shortest = min(s.round_trip_ns for s in samples)
    if shortest > 10_000_000:
        assert m is None
    else:
        assert m is not None
        assert m.round_trip_ns == shortest
        assert any(offset_of(s) == m.offset_ns for s in samples if s.round_trip_ns == shortest)


class _Bridge:
    """Runs the 'asyncio' functions directly: the guest below is plain trio code."""

    async def call(self, fn: Any, *args: Any) -> Any:
        return await fn(*args)


class _Guest:
    def __init__(self, skew_ns: int, *, adjust: bool) -> None:
        self.skew_ns = skew_ns
        self.adjust = adjust
        self.calls: list[tuple[str, int]] = []

    async def get_time(self) -> int:
        return time.time_ns() + self.skew_ns

    async def adjust_time(self, offset_ns: int) -> bool:
        self.calls.append(("adjust", offset_ns))
        if not self.adjust:
            raise FeosError(Code.UNIMPLEMENTED, "adjustTime")
        self.skew_ns += offset_ns
        return True

    async def set_time(self, ns: int) -> None:
        self.calls.append(("set", ns))
        self.skew_ns = ns - time.time_ns()


async def test_clock_loop_adjusts_once_a_minute(autojump_clock: trio.testing.MockClock) -> None:
    guest = _Guest(250_000_000, adjust=True)
    link = GuestLink("abcdefghjkm", None, _Bridge(), clock_interval=60.0)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link._clock_loop, guest)
        await trio.sleep(59)
        assert guest.calls == []
        await trio.sleep(2)
        assert [c[0] for c in guest.calls] == ["adjust"]
        assert abs(guest.calls[0][1] + 250_000_000) < 5_000_000
        assert link.last_clock is not None
        assert link.last_clock.action == "adjusted"
        await trio.sleep(60)
        assert len(guest.calls) == 2
        assert abs(guest.calls[1][1]) < 5_000_000
        nursery.cancel_scope.cancel()


async def test_set_time_when_unimplemented() -> None:
    link = GuestLink("abcdefghjkm", None, _Bridge())  # type: ignore[arg-type]
    far = _Guest(-90_000_000, adjust=False)
    step = await link.keep_clock(far)
    assert step.action == "set"
    assert [c[0] for c in far.calls] == ["adjust", "set"]
    assert abs(far.skew_ns) < 5_000_000
    near = _Guest(5_000_000, adjust=False)
    assert (await link.keep_clock(near)).action == "kept"


async def test_failures_are_rounds_that_failed() -> None:
    class Broken(_Guest):
        async def get_time(self) -> int:
            raise FeosError(Code.UNAVAILABLE, "the guest link broke")

    link = GuestLink("abcdefghjkm", None, _Bridge())  # type: ignore[arg-type]
    assert (await link.keep_clock(Broken(0, adjust=True))).action == "failed"
