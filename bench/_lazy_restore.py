"""The lazy restore beside the full download restore: bench/hibernate.py's part (c).

Run as root alone: flock /tmp/feos-vm.lock .venv/bin/python bench/_lazy_restore.py [--rounds 3]
(bench/hibernate.py calls `lazy_restore(root, s3)` within its own run.)

Firecracker boots only the tiny test kernels here (no Debian guest: /dev/kvm is PVM), so the
microVM is the pattern kernel (integration/fc_pattern.py) with 512 MiB, the pod's size: it fills
480 MiB of its memory with its pattern (memory that is not zero, as a working guest's is), then
reads and checks a fixed share of it, 64 MiB, over and over. It is snapshotted, its memory pushed
into moto's S3 through diskd, and the file removed from the node. Each round, from diskd's chunk
cache emptied (diskd restarted on an empty cache), is timed from the restore's start to the end
of the first whole pass over the share after it (the second "K" on its console):

- lazy: serveMemory, Firecracker's snapshot/load with the Uffd backend on diskd's memory.sock,
  resume; the pages come from the store as the share is read;
- full download: pullMemory of the whole snapshot into the jail, snapshot/load with the File
  backend, resume.

Rounds alternate, the ratio is of medians. Target < 0.6: a restore that waits only for what the
guest touches (64 of 480 MiB) rather than for all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

import _owner  # noqa: E402
import fc_pattern  # noqa: E402
from _owner import kept_dir  # noqa: E402
from diskd_proc import DiskdProc  # noqa: E402
from fc_pattern import PATTERN_BAD, PATTERN_OK, serial_after, serial_size  # noqa: E402
from moto_s3 import MotoS3, moto_s3  # noqa: E402

from feos.vmm._driver import VmHandle  # noqa: E402
from feos.vmm._firecracker import FirecrackerDriver  # noqa: E402

MEMORY_MIB = 512
FILL = 480 << 20
TARGET_LAZY = 0.6


def _first_pass(driver: FirecrackerDriver, vm: VmHandle, before: int) -> None:
    seen = serial_after(driver, vm, before, PATTERN_OK * 2, 300)
    if PATTERN_BAD in seen:
        raise SystemExit("the pattern kernel found its memory wrong after the restore")


class Rounds:
    def __init__(self, root: Path, s3: MotoS3, driver: FirecrackerDriver, vm: VmHandle,
                 stack: contextlib.ExitStack) -> None:  # fmt: skip
        self.root, self.driver, self.vm = root, driver, vm
        self.diskd = stack.enter_context(DiskdProc(root / "disk", env=s3.env()).start())
        trio.run(lambda: driver.suspend(vm, snapshot_timeout=120))
        snapshot = driver.directory(vm.id) / "snapshot"
        self.digest = self.diskd.call("pushMemory", id=vm.id,
                                      path=str(snapshot / "memory"))["memory"]["digest"]
        self.vmstate = root / "vmstate"
        shutil.copy(snapshot / "vmstate", self.vmstate)
        (snapshot / "memory").unlink()
        record = driver.jail(vm.id).read()
        assert record is not None
        self.uid = record.uid

    def _fresh(self) -> None:
        """The VM ended, the snapshot's state back, diskd on an empty chunk cache."""
        trio.run(lambda: self.driver.shutdown(self.vm, grace=0.1))
        with contextlib.suppress(Exception):
            self.diskd.call("stopMemory", id=self.vm.id)
        self.diskd.stop()
        shutil.rmtree(self.diskd.state_dir / "cache", ignore_errors=True)
        self.diskd.start()
        snapshot = self.driver.directory(self.vm.id) / "snapshot"
        shutil.copy(self.vmstate, snapshot / "vmstate")
        (snapshot / "memory").unlink(missing_ok=True)

    def lazy(self) -> float:
        self._fresh()
        before = serial_size(self.driver, self.vm)
        start = time.monotonic()
        self.diskd.call("serveMemory", id=self.vm.id, digest=self.digest,
                        socket=str(self.driver.memory_socket(self.vm.id)), ownerUid=self.uid)
        trio.run(lambda: self.driver.resume(self.vm, within=30, lazy_memory=True))
        _first_pass(self.driver, self.vm, before)
        return time.monotonic() - start

    def full(self) -> float:
        self._fresh()
        before = serial_size(self.driver, self.vm)
        memory = self.driver.directory(self.vm.id) / "snapshot" / "memory"
        start = time.monotonic()
        self.diskd.call("pullMemory", id=self.vm.id, digest=self.digest, path=str(memory),
                        ownerUid=self.uid)
        trio.run(lambda: self.driver.resume(self.vm, within=30))
        _first_pass(self.driver, self.vm, before)
        return time.monotonic() - start


def lazy_restore(root: Path, s3: MotoS3, rounds: int = 3) -> tuple[float, float] | str:
    """(median seconds of the lazy restore, of the full download restore), or why not."""
    if not Path("/dev/kvm").exists():
        return "not measured: no /dev/kvm here (Firecracker needs it, even for the test kernel)"
    fc_pattern.firecracker_root()
    lazy: list[float] = []
    full: list[float] = []
    with contextlib.ExitStack() as stack:
        bases = stack.enter_context(fc_pattern.cgroup_parents())
        driver, vm = stack.enter_context(fc_pattern.pattern_vm(
            root / "fc", root / "fc-guest", bases, memory_mib=MEMORY_MIB, fill_bytes=FILL))
        bench = Rounds(root, s3, driver, vm, stack)
        for i in range(rounds):
            for name, run, into in (("lazy", bench.lazy, lazy), ("full", bench.full, full)):
                into.append(run())
                print(f"(c) round {i + 1}: {name} restore to a whole pass over 64 MiB: "
                      f"{into[-1]:.2f}s", flush=True)
    return statistics.median(lazy), statistics.median(full)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"Firecracker's pattern kernel, {MEMORY_MIB} MiB, {FILL >> 20} MiB of it filled, "
          "64 MiB read after the restore; one moto S3, one diskd", flush=True)
    with kept_dir("feos-bench-lazy-", False) as tmp:
        root = Path(tmp)
        with moto_s3(root) as s3:
            answer: Any = lazy_restore(root, s3, args.rounds)
    if isinstance(answer, str):
        print(f"lazy restore: {answer}")
        return 0
    lazy_s, full_s = answer
    print(f"ratio lazy restore / full download restore: {lazy_s / full_s:.2f} "
          f"(target < {TARGET_LAZY})")
    return 0


if __name__ == "__main__":
    sys.exit(_owner.main(main))
