"""Firecracker's Uffd restore served lazily by diskd, for real: Firecracker v1.12.1 in its jailer
runs the pattern kernel (integration/fc_pattern.py: 64 MiB of a known pattern written, then read
over and over), is snapshotted, its memory pushed into a real object store (moto_server) and
removed from the node; the same microVM restored with Firecracker's Uffd memory backend from
diskd's memory.sock reads its whole 64 MiB again and finds every word right, each page
fetched through diskd as it faulted; fillMemory then makes its memory whole.

No Debian guest boots under Firecracker here (/dev/kvm is PVM: a stock kernel dies with
KVM_EXIT_INTERNAL_ERROR, environment.md), so a pod's hibernation under Firecracker is tested with
this kernel only; test_a_debian_guest_restores_lazily skips with the probe's reason.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fc_pattern
import pytest
import trio
from diskd_proc import DiskdProc
from fc_pattern import PATTERN_BAD, PATTERN_BYTES, PATTERN_OK, serial_after, serial_size
from moto_s3 import moto_s3

from feos.vmm import _kvm
from feos.vmm._driver import VmHandle, VmState
from feos.vmm._firecracker import FirecrackerDriver

pytestmark = pytest.mark.skipif(not Path("/dev/kvm").exists(), reason="no /dev/kvm here")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[DiskdProc, FirecrackerDriver, VmHandle]]:  # fmt: skip
    fc_pattern.firecracker_root()
    tmp = tmp_path_factory.mktemp("fcuffd")
    with (moto_s3(tmp) as s3, DiskdProc(tmp / "disk", env=s3.env()).start() as diskd,
          fc_pattern.cgroup_parents() as bases,
          fc_pattern.pattern_vm(tmp / "state", tmp / "guest", bases) as (driver, vm)):  # fmt: skip
        yield diskd, driver, vm


def test_a_uffd_restore_served_lazily_by_diskd_finds_its_pattern(
    world: tuple[DiskdProc, FirecrackerDriver, VmHandle], tmp_path: Path
) -> None:
    diskd, driver, vm = world
    trio.run(lambda: driver.suspend(vm, snapshot_timeout=60))
    memory = driver.directory(vm.id) / "snapshot" / "memory"
    pushed = diskd.call("pushMemory", id=vm.id, path=str(memory))["memory"]
    assert pushed["sizeBytes"] == fc_pattern.PATTERN_MEMORY_MIB << 20
    assert pushed["storedChunks"] >= PATTERN_BYTES // (4 << 20)  # the pattern's, at least
    shutil.move(memory, tmp_path / "memory")  # the node keeps none of it: diskd has to serve
    record = driver.jail(vm.id).read()
    assert record is not None
    server = diskd.call("serveMemory", id=vm.id, digest=pushed["digest"],
                        socket=str(driver.memory_socket(vm.id)), ownerUid=record.uid)["server"]
    assert server["state"] == "listening"
    assert os.stat(driver.memory_socket(vm.id)).st_uid == record.uid
    before = serial_size(driver, vm)
    trio.run(lambda: driver.resume(vm, within=20, lazy_memory=True))
    # the pass the snapshot cut goes on first; the second "K" ends a whole pass after the restore
    seen = serial_after(driver, vm, before, PATTERN_OK * 2, 120)
    assert PATTERN_BAD not in seen, seen
    server = served(diskd, vm.id)
    assert server["state"] == "serving" and server["vmmPid"] == driver.pid(vm)
    assert server["faults"] > 0
    assert server["pagesIn"] >= PATTERN_BYTES // 4096  # every page of the pattern through diskd
    assert trio.run(driver.state, vm) == VmState.RUNNING
    server = diskd.call("fillMemory", id=vm.id)["server"]
    assert server["state"] == "filled" and server["pagesIn"] <= server["pagesTotal"]
    again = serial_size(driver, vm)
    assert PATTERN_OK in serial_after(driver, vm, again, PATTERN_OK, 60)  # it reads on
    # a suspend now reads no page through the handler: its memory is whole
    faults = served(diskd, vm.id)["faults"]
    trio.run(lambda: driver.suspend(vm, snapshot_timeout=60))
    assert served(diskd, vm.id)["faults"] == faults
    assert until_state(diskd, vm.id, "ended")["reason"] == "its VMM ended"
    diskd.call("stopMemory", id=vm.id)


def served(diskd: DiskdProc, pod: str) -> dict[str, Any]:
    server: dict[str, Any] = diskd.call("getMemoryServer", id=pod)["server"]
    return server


def until_state(diskd: DiskdProc, pod: str, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (server := served(diskd, pod))["state"] != state:
        assert time.monotonic() < deadline, server
        time.sleep(0.05)
    return server


def test_a_debian_guest_restores_lazily() -> None:
    answer = _kvm.kvm_probe()
    if not answer.usable:
        pytest.skip(f"/dev/kvm cannot really run a guest here: {answer.reason}; so no Debian "
                    "guest boots under Firecracker, and its lazy restore is tested with the "
                    "pattern kernel only (test_a_uffd_restore_served_lazily_by_diskd_finds_its_"
                    "pattern)")
    pytest.skip("a Debian guest under Firecracker: not built on this host's kind (no KVM that "
                "runs stock kernels to build and test it on)")
