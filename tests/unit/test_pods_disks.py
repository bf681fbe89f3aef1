"""A pod's disk follows its microVM (feos.pods._disks over a fake diskd): stopped after a stop,
a suspend and a shutdown of the guest's own, started again before a resume, deleted with the
pod, and a delete that diskd no longer knows is done; under trio's autojump clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio.testing
from _podfakes import P1, FakeDiskd, node, running_pod

from feos.errors import Code, FeosError
from feos.pods._disks import PodDisks


def disk_calls(diskd: FakeDiskd) -> list[str]:
    return [method for method, disk_id in diskd.calls if disk_id == P1]


async def test_stop_suspend_resume_and_delete_move_the_disk(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        await made.pods.suspend_pod({"id": P1})
        assert made.diskd.states[P1] == "stopped"
        await made.pods.resume_pod({"id": P1})
        assert made.diskd.states[P1] == "started"
        await made.pods.stop_pod({"id": P1})
        assert made.diskd.states[P1] == "stopped"
        await made.pods.delete_pod({"id": P1})
        assert disk_calls(made.diskd) == ["stopDisk", "startDisk", "stopDisk", "deleteDisk"]
        assert P1 not in made.diskd.states


async def test_a_guest_that_shuts_down_stops_its_disk(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.diskd.states[P1] = "started"
        made.vms.stops_itself(P1)
        await trio.testing.wait_all_tasks_blocked()
        await made.pods._changes.wait_idle()
        assert made.state(P1) == "stopped"
        assert made.diskd.states[P1] == "stopped"


async def test_a_disk_diskd_does_not_know_is_deleted_already(tmp_path: Path) -> None:
    disks = PodDisks(tmp_path, FakeDiskd())
    await disks.delete("gone", tmp_path / "gone.img")  # NOT_FOUND: nothing to do
    plain = tmp_path / "plain.img"
    plain.write_bytes(b"x")
    await disks.delete("gone", plain)
    assert not plain.exists()


async def test_a_disk_needed_without_diskd_fails_naming_it(tmp_path: Path) -> None:
    disks = PodDisks(tmp_path, None)
    with pytest.raises(FeosError) as caught:
        await disks.volume("v", tmp_path / "v.disk", 64 << 20, "qemu")
    assert caught.value.code is Code.UNAVAILABLE and "diskd" in caught.value.message
    await disks.stop(["v"])  # a stop needs none
