"""A state directory deep enough that a microVM's guest.sock and qmp.sock pass the kernel's 108
bytes for a Unix socket's path: the microVM still boots, its guest attaches, and a suspend and
resume rejoins the guest's session (feosd reaches the sockets through /proc/self/fd, _sockpath).
Before, the guest "did not attach within 60s"."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import trio

import feos.rpc
from feos.errors import FeosError
from feos.vmm import _cgroup
from feos.vmm._driver import VmSpec, VmState
from feos.vmm._qemu import _is_ours
from feos.vmm._service import MicroVms, newest_guest

VM = "dddddddddd1"
GUESTS = Path(os.environ.get("FEOS_GUEST_DIR", "/usr/lib/feos/guest"))
PR_SET_CHILD_SUBREAPER = 36


def _kill(state: Path) -> None:
    d = state / "vms" / "qemu" / VM
    try:
        pid = int((d / "qemu.pid").read_text())
    except (OSError, ValueError):
        return
    if _is_ours(pid, VM, d):
        os.kill(pid, 9)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


async def test_a_microvm_below_a_deep_state_dir_attaches(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the QEMU tests need root (chroot, runas and cgroups)")
    try:
        _, gdir = newest_guest(GUESTS)
    except FeosError as exc:
        pytest.fail(f"no guest installed: {exc.message} (run hack/guest-image)")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    state = tmp_path / ("s" * 70) / ("t" * 70)
    state.mkdir(parents=True)
    assert len(str(state / "vms" / "qemu" / VM / "guest.sock")) > 150
    disk = tmp_path / "data.img"
    await trio.run_process(["zstd", "-q", "-d", "-f", "--sparse", str(gdir / "data.img.zst"),
                            "-o", str(disk)])  # fmt: skip
    cgroups = _cgroup.detect()
    try:
        async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as nursery:
            vms = MicroVms(state, state / "run", bridge, accel="tcg", cgroups=cgroups,
                           attach_timeout=60)
            await nursery.start(vms.run)
            await vms.create(VM, VmSpec(vcpus=1, memory_mib=512, data_disk=str(disk)))
            info = await vms.start(VM)
            assert (info.state, info.attached) == (VmState.RUNNING, True)
            boot = (await (await vms.guest(VM)).ping()).boot_id
            await vms.suspend(VM)  # qmp.sock's migration, then a new QEMU's guest.sock
            assert (await vms.resume(VM)).state is VmState.RUNNING
            assert (await (await vms.guest(VM)).ping()).boot_id == boot
            await vms.delete(VM)
            nursery.cancel_scope.cancel()
    finally:
        _kill(state)
        _cgroup.remove(cgroups, VM)
