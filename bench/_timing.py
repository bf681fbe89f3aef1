"""The timing loop the API benchmarks share: each call's seconds, after an untimed warm-up."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


async def timed(fn: Callable[[], Awaitable[object]], count: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `count` awaited calls of fn, after `warmup` calls not timed."""
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
