"""Waits for the asyncio tests, in place of sleeps: until the loop is idle, until a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def idle(within: float = 5.0) -> None:
    """Until every task has run up to an await that is not ready: asyncio's counterpart of
    trio.testing.wait_all_tasks_blocked. Each round lets the loop poll its sockets (a select
    without a timeout while a callback is ready), so what the kernel has ready is taken too."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(within):
        quiet = 0
        while quiet < 2:  # twice in a row: a callback a socket's readiness added is seen
            await asyncio.sleep(0)
            quiet = quiet + 1 if not loop._ready else 0  # type: ignore[attr-defined]


async def until(cond: Callable[[], bool], within: float = 5.0, poll: float = 0.001) -> None:
    """A bounded poll of a condition that no event announces."""
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 (a condition without an event)
            await asyncio.sleep(poll)
