"""The microVM state table, how a VMM's end is read, the zero-page punching and the QEMU argv."""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.vmm._driver import Driver, VmHandle, VmSpec, VmState
from feos.vmm._qemu import (
    QemuDriver,
    _aligned_zero_runs,
    cmdline_names,
    exit_of,
    punch_zeros,
    zero_runs,
)  # fmt: skip
from feos.vmm._service import is_noop, newest_guest, next_state

S = VmState


@pytest.mark.parametrize(
    ("state", "op", "to"),
    [(S.CREATED, "start", S.RUNNING), (S.STOPPED, "start", S.RUNNING),
     (S.CRASHED, "start", S.RUNNING), (S.RUNNING, "suspend", S.SUSPENDED),
     (S.RUNNING, "shutdown", S.STOPPED), (S.SUSPENDED, "resume", S.RUNNING),
     (S.RUNNING, "late", S.BUSY), (S.BUSY, "late-done", S.RUNNING),
     (S.RUNNING, "crashed", S.CRASHED)],
)  # fmt: skip
def test_allowed(state: VmState, op: str, to: VmState) -> None:
    assert next_state(state, op) is to


@pytest.mark.parametrize("op", ["suspend", "shutdown", "start", "resume"])
def test_busy_refuses_with_the_marker(op: str) -> None:
    with pytest.raises(FeosError) as e:
        next_state(S.BUSY, op)
    assert e.value.code == Code.UNAVAILABLE
    assert e.value.busy
    assert e.value.message.startswith("the VM is busy: ")


@pytest.mark.parametrize(
    ("state", "op"),
    [(S.CREATED, "suspend"), (S.SUSPENDED, "shutdown"), (S.STOPPED, "resume"),
     (S.CREATED, "resume"), (S.SUSPENDED, "start")],
)  # fmt: skip
def test_refused(state: VmState, op: str) -> None:
    with pytest.raises(FeosError) as e:
        next_state(state, op)
    assert e.value.code == Code.FAILED_PRECONDITION
    assert not e.value.busy


def test_noops() -> None:
    assert is_noop(S.RUNNING, "start")
    assert is_noop(S.SUSPENDED, "suspend")
    assert is_noop(S.STOPPED, "shutdown")
    assert not is_noop(S.RUNNING, "suspend")


def test_exit_of() -> None:
    assert exit_of(0, None, False).state is S.STOPPED
    assert exit_of(None, 9, True).state is S.CRASHED
    assert exit_of(None, 9, True).reason == "QEMU was killed by signal 9"
    assert exit_of(1, None, True).state is S.CRASHED
    assert exit_of(None, None, True).state is S.STOPPED  # adopted: the guest's SHUTDOWN decides
    assert exit_of(None, None, False).state is S.CRASHED


def test_cmdline_names_its_vm() -> None:
    ours = b"/usr/bin/qemu-system-x86_64\0-M\0microvm\0-name\0feos-abcdefghjkm\0"
    assert cmdline_names(ours, "abcdefghjkm")
    assert not cmdline_names(ours, "bcdefghjkmn")
    assert not cmdline_names(b"/bin/sleep\0-name\0feos-abcdefghjkm\0", "abcdefghjkm")


def test_zero_runs() -> None:
    z, x = bytes(4096), b"x" * 4096
    assert zero_runs(x + z + z + x + z) == [(4096, 8192), (16384, 4096)]
    assert zero_runs(x + z + b"tail", base=100) == [(4196, 4096)]
    assert zero_runs(b"\0" * 4095) == []


def test_punch_zeros(tmp_path: Path) -> None:
    f = tmp_path / "memory"
    data = b"x" * 4096 + bytes(3 << 20) + b"y" * 5000
    f.write_bytes(data)
    before = os.stat(f).st_blocks * 512
    assert punch_zeros(f) == 3 << 20
    st = os.stat(f)
    assert st.st_size == len(data)
    assert f.read_bytes() == data
    assert st.st_blocks * 512 < before - (2 << 20)
    assert st.st_blocks * 512 < st.st_size


def _guest(root: Path, name: str, built: str) -> None:
    (root / name).mkdir()
    (root / name / "manifest.json").write_text(json.dumps({"version": name, "built": built}))


def test_newest_guest(tmp_path: Path) -> None:
    _guest(tmp_path, "aaaaaaaaaaaa", "2026-12-01T08:00:00+00:00")
    _guest(tmp_path, "bbbbbbbbbbbb", "2026-12-01T07:00:00+00:00")
    (tmp_path / "broken").mkdir()
    assert newest_guest(tmp_path) == ("aaaaaaaaaaaa", tmp_path / "aaaaaaaaaaaa")
    with pytest.raises(FeosError) as e:
        newest_guest(tmp_path / "none")
    assert e.value.code == Code.FAILED_PRECONDITION


def test_qemu_driver_is_a_driver_and_its_argv(tmp_path: Path) -> None:
    driver = QemuDriver(tmp_path, tsc_khz=2596144)
    assert isinstance(driver, Driver)
    vm = VmHandle("abcdefghjkm", VmSpec(vcpus=2, memory_mib=256, data_disk="/x/d",
                                         volumes=("/x/v",), tap="pod-x", mac="06:00:aa:bb:cc:dd"),
                  driver.directory("abcdefghjkm"), "v1", tmp_path / "g", uid=2000000)  # fmt: skip
    argv = driver.argv(vm)
    joined = " ".join(argv)
    d = tmp_path / "vms" / "qemu" / "abcdefghjkm"
    assert "file=root.erofs" in joined
    assert "serial=root" in joined
    assert "serial=data" in joined
    assert "serial=vol1" in joined
    assert "file=volume0" in joined
    assert "tsc_early_khz=2596144" in joined
    assert "vhost=off" in joined
    assert "-serial chardev:console" in joined
    assert "stdio,id=console,signal=off" in joined
    assert "free-page-reporting=on" in joined
    assert "virtio-rng-device" in joined
    # this machine's QEMU (Debian 12's) has qboot: the microVM boots with it, no option ROMs
    assert argv[1:5] == ["-M", "microvm,x-option-roms=off", "-bios", "qboot.rom"]
    if os.geteuid() == 0:
        assert ["-chroot", str(d)] == argv[argv.index("-chroot"):][:2]
        assert ["-runas", "2000000:2000000"] == argv[argv.index("-runas"):][:2]
        assert "elevateprivileges" not in joined
        assert "spawn=deny" in joined


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * 4096)), max_size=12))
def test_the_fast_zero_search_agrees_with_the_obvious_one(parts: list[tuple[bool, int]]) -> None:
    data = b"".join(bytes(n) if zero else b"\x01" * n for zero, n in parts)
    if len(data) < 4096:
        return
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        with mmap.mmap(f.fileno(), len(data), prot=mmap.PROT_READ) as view:
            assert _aligned_zero_runs(view, len(data)) == zero_runs(data)
