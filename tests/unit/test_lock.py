"""feosd's one-per-node lock (feos/_lock.py), through feos.native's flock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from feos import native
from feos._lock import holder, take_lock

pytestmark = pytest.mark.skipif(
    not native.available(), reason="feos._native is not built: python native/build.py"
)


async def test_the_lock_waits_for_its_holder_and_then_names_us(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "state" / "feosd.lock"
    path.parent.mkdir()
    other = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    path.write_text("4242\n")
    assert native.flock(other, wait=False)
    taken: list[int] = []

    async def take() -> None:
        taken.append(await take_lock(path, retry=1.0))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            await trio.sleep(30)  # thirty tries, each refused
            assert not taken
            assert holder(path) == "4242"
            native.unlock(other)
    finally:
        os.close(other)
    [fd] = taken
    try:
        assert holder(path) == str(os.getpid())
        again = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            assert not native.flock(again, wait=False)  # held by the fd take_lock returned
        finally:
            os.close(again)
    finally:
        os.close(fd)
