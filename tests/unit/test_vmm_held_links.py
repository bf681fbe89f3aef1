"""The guest links held at feosd's start (`hold_links`): a microVM taken over running gets its
link at once, but the link dials its guest only after `open_links()` (feosd calls it once its
API serves); a guest call meanwhile waits for the link and has the guest once it attached, and
one whose link stays away answers UNAVAILABLE saying so. And the other end of a restart, the
stop: the sessions are closed together, bounded. Fake driver and guest, no VMM."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from test_vmm_drivers import QEMU_TCG, FakeDriver, _record
from test_vmm_guestlink import Bridge, stub_waits

import feos.vmm._guestlink as gl
from feos.errors import Code, FeosError
from feos.vmm._driver import VmSpec, VmState
from feos.vmm._records import Records, VmRecord
from feos.vmm._service import MicroVms

POD = "abcdefghjkm"  # test_vmm_drivers' _record's


class Client:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.boot_id = "boot"
        self.ended = trio.Event()

    async def set_time(self, ns: int) -> None:
        self.log.append("set_time")

    async def get_time(self) -> int:  # the clock's rounds, where a test's clock jumps to them
        return time.time_ns()

    async def adjust_time(self, offset_ns: int) -> bool:
        return True

    async def close(self) -> None:
        self.ended.set()


@pytest.fixture
def dials(monkeypatch: Any) -> list[float]:
    """The links' dials (their times): each answered by a fake guest that attaches at once."""
    stub_waits(monkeypatch)
    made: list[float] = []
    log: list[str] = []

    async def connect(path: str) -> Client:
        made.append(trio.current_time())
        return Client(log)

    monkeypatch.setattr(gl, "connect_poking", connect)
    return made


def _service(tmp_path: Path, *, hold_links: bool) -> MicroVms:
    _record(tmp_path, "qemu", VmState.RUNNING)
    return MicroVms(tmp_path / "state", tmp_path / "run", Bridge(),
                    drivers={"qemu": FakeDriver("qemu", tmp_path)}, choice=QEMU_TCG,
                    guest_dir=tmp_path / "guest", hold_links=hold_links,
                    clock_interval=1e6)  # no clock rounds here


async def test_a_held_link_dials_only_once_opened(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, dials: list[float]
) -> None:
    vms = _service(tmp_path, hold_links=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(vms.run)
        assert vms.get(POD).state is VmState.RUNNING  # taken over, its link made
        await trio.sleep(30)
        assert dials == []  # held: no dial before the API serves
        got: list[Any] = []

        async def call() -> None:
            got.append(await vms.guest(POD, within=5))

        nursery.start_soon(call)
        await trio.sleep(1)
        assert got == []  # the call waits for the link
        opened = trio.current_time()
        vms.open_links()
        await trio.sleep(0.5)
        assert dials == [opened]  # at once, not after a back-off
        assert len(got) == 1 and vms.get(POD).attached
        nursery.cancel_scope.cancel()


async def test_a_link_not_held_dials_at_the_take_over(tmp_path: Path, dials: list[float]) -> None:
    vms = _service(tmp_path, hold_links=False)  # as tests and tools make the service
    async with trio.open_nursery() as nursery:
        await nursery.start(vms.run)
        with trio.fail_after(5):
            await vms.guest(POD, within=5)
        assert len(dials) == 1
        nursery.cancel_scope.cancel()


async def test_a_call_whose_link_is_not_back_says_so(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, dials: list[float]
) -> None:
    vms = _service(tmp_path, hold_links=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(vms.run)
        with pytest.raises(FeosError) as caught:
            await vms.guest(POD, within=5)
        assert caught.value.code is Code.UNAVAILABLE
        assert caught.value.message == (f"the guest of pod {POD} did not answer within 5s (its "
                                        "link has not re-attached since feosd started)")
        nursery.cancel_scope.cancel()


async def test_the_stop_closes_the_sessions_at_once_and_bounded(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: Any
) -> None:
    """feosd's stop: ten sessions whose close never ends are let go together, after the one
    bound of 2 s, not one after another."""
    stub_waits(monkeypatch)

    class Stuck(Client):
        async def close(self) -> None:
            await trio.sleep_forever()

    async def connect(path: str) -> Client:
        return Stuck([])

    monkeypatch.setattr(gl, "connect_poking", connect)
    records = [f"abcdefghj{i:02d}" for i in range(10)]
    (tmp_path / "state").mkdir()
    kept = Records(tmp_path / "state" / "vms.db")
    for i, vm_id in enumerate(records):
        kept.put(VmRecord(vm_id, "qemu", VmState.RUNNING, "", "g1", "tcg", VmSpec(), 2_000_000 + i))
    kept.close()
    vms = MicroVms(tmp_path / "state", tmp_path / "run", Bridge(),
                   drivers={"qemu": FakeDriver("qemu", tmp_path)}, choice=QEMU_TCG,
                   guest_dir=tmp_path / "guest", clock_interval=1e6)
    async with trio.open_nursery() as nursery:
        await nursery.start(vms.run)
        with trio.fail_after(5):
            for vm_id in records:
                await vms.guest(vm_id, within=5)
        stop = trio.current_time()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - stop < 2.5
