"""The microVMs' cgroups in the host's real hierarchies, below a throwaway parent feostest-*.

v1 is what this host enforces (cpu, memory, pids); v2 runs in the unified hierarchy as far as it
goes without its cpu and memory controllers (the layout, the leaf move, the processes)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from feos.errors import FeosError
from feos.vmm import _cgroup as cg

ROOT = Path("/sys/fs/cgroup")


def _rmtree_cgroup(d: Path) -> None:
    """Remove a cgroup tree bottom-up, killing what is still in it (a failed test's leftovers)."""
    if not d.exists():
        return
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        for pid in cg.pids_in(sub):
            os.kill(pid, signal.SIGKILL)
        sub.rmdir()
    for pid in cg.pids_in(d):
        os.kill(pid, signal.SIGKILL)
    d.rmdir()


@pytest.fixture
def v1_parent() -> Iterator[cg.V1Layout]:
    name = f"feostest-{secrets.token_hex(4)}"
    bases = {h: ROOT / h / name for h in cg.V1_HIERARCHIES if (ROOT / h / "tasks").exists()}
    if "cpu" not in bases:
        pytest.fail("this host has no v1 cpu hierarchy at /sys/fs/cgroup/cpu (environment.md)")
    for d in bases.values():
        d.mkdir()
    try:
        yield cg.V1Layout(bases=bases)
    finally:
        for d in bases.values():
            _rmtree_cgroup(d)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _cgroup_of(pid: int) -> dict[str, str]:
    return cg.parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())


def test_v1_create_move_remove(v1_parent: cg.V1Layout, sleeper: subprocess.Popen[bytes]) -> None:
    cg.prepare(v1_parent)
    cg.prepare(v1_parent)  # idempotent: a restart of feosd does it again
    dirs = cg.create(v1_parent, "vm1", 3)
    assert (v1_parent.vms("cpu") / "vm1" / "cpu.shares").read_text().strip() == "3072"
    if "memory" in v1_parent.bases:  # no cap: the kernel's unlimited
        limit = int((v1_parent.vms("memory") / "vm1" / "memory.limit_in_bytes").read_text())
        assert limit >= 1 << 62
    cg.add_pid(v1_parent, "vm1", sleeper.pid)
    seen = _cgroup_of(sleeper.pid)
    for h, base in v1_parent.bases.items():
        assert seen[h] == f"/{base.name}/vms/vm1"
    with pytest.raises(FeosError, match="cannot remove cgroup"):
        cg.remove(v1_parent, "vm1")  # a process is in it
    sleeper.kill()
    sleeper.wait()
    cg.remove(v1_parent, "vm1")
    assert not any(d.exists() for d in dirs)
    cg.remove(v1_parent, "vm1")  # gone already: nothing to do


def test_v1_shares_are_enforced_by_the_kernel(v1_parent: cg.V1Layout) -> None:
    cg.prepare(v1_parent)
    cg.create(v1_parent, "big", 32)
    cg.create(v1_parent, "one", 1)
    assert (v1_parent.vms("cpu") / "big" / "cpu.shares").read_text().strip() == "32768"
    assert (v1_parent.vms("cpu") / "one" / "cpu.shares").read_text().strip() == "1024"
    # no caps: quota unlimited
    assert (v1_parent.vms("cpu") / "big" / "cpu.cfs_quota_us").read_text().strip() == "-1"
    cg.remove(v1_parent, "big")
    cg.remove(v1_parent, "one")


UNIFIED = ROOT / "unified"


@pytest.fixture
def v2_parent() -> Iterator[Path]:
    if not (UNIFIED / "cgroup.procs").exists():
        pytest.fail("this host has no cgroup2 at /sys/fs/cgroup/unified (environment.md)")
    d = UNIFIED / f"feostest-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        yield d
    finally:
        _rmtree_cgroup(d)


def test_v2_leaf_move_and_vm_cgroup(v2_parent: Path, sleeper: subprocess.Popen[bytes]) -> None:
    # The sleeper stands for feosd: it sits in its cgroup, which is not the real root.
    (v2_parent / "cgroup.procs").write_text(str(sleeper.pid))
    assert not cg.is_real_root(v2_parent)
    assert cg.is_real_root(UNIFIED)
    # cpu and memory are missing from this host's cgroup2: the rest of the layout runs
    layout = cg.v2_layout_for(v2_parent, controllers=())
    assert layout.leaf == v2_parent / "feosd"
    cg.prepare(layout)  # every process of the base moves into the leaf
    assert _cgroup_of(sleeper.pid)[""].endswith(f"/{v2_parent.name}/feosd")
    assert cg.pids_in(v2_parent) == []
    cg.create(layout, "vm1", 2)
    vm = v2_parent / "vms" / "vm1"
    assert (vm / "cgroup.type").read_text().strip() == "domain"
    cg.add_pid(layout, "vm1", sleeper.pid)
    assert cg.pids_in(vm) == [sleeper.pid]
    # a restart of feosd, already in its leaf: the base stays, nothing moves again
    assert cg.v2_layout_for(v2_parent / "feosd", controllers=()).base == v2_parent
    sleeper.kill()
    sleeper.wait()
    cg.remove(layout, "vm1")
    assert not vm.exists()


def test_v2_controllers_outside_the_available_fail_clearly(v2_parent: Path) -> None:
    layout = cg.v2_layout_for(v2_parent)
    with pytest.raises(FeosError, match="the microVMs' cgroups"):
        cg.prepare(layout)


def test_detect_on_this_host() -> None:
    layout = cg.detect()
    assert isinstance(layout, cg.V1Layout)
    own = _cgroup_of(os.getpid())
    assert layout.bases["cpu"] == ROOT / "cpu" / own["cpu"].lstrip("/")


def test_v1_hand_over_to_vms_cgroup(v1_parent: cg.V1Layout,
                                    sleeper: subprocess.Popen[bytes]) -> None:
    """A feosd from before --vms-cgroup left a microVM below its unit's cgroup: it moves into
    the one --vms-cgroup names with its weight, and the old vms/ goes (feosd --hand-over-vms)."""
    unit = cg.V1Layout(bases={h: b / "feosd.service" for h, b in v1_parent.bases.items()})
    vms = cg.V1Layout(bases={h: b / "feos-vms.service" for h, b in v1_parent.bases.items()})
    cg.prepare(unit)
    cg.create(unit, "vm1", 2)
    cg.add_pid(unit, "vm1", sleeper.pid)
    assert cg.hand_over(unit, vms) == ["vm1"]
    seen = _cgroup_of(sleeper.pid)
    for h, base in v1_parent.bases.items():
        assert seen[h] == f"/{base.name}/feos-vms.service/vms/vm1"
        assert not (base / "feosd.service" / "vms").exists()
    assert (vms.vms("cpu") / "vm1" / "cpu.shares").read_text().strip() == "2048"
    assert cg.hand_over(unit, vms) == []  # again: nothing left to move
