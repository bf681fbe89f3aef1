"""The microVM layer against real QEMU guests (TCG): boot, attach, clock, suspend and resume,
takeover by a new service after kill -9, late snapshots, shutdown, crashes and faults.

The VMs outlive each test's service, as they outlive feosd: the module keeps one state
directory, and every test opens a new MicroVms on it (in its own trio run), which takes the VMs
over. So two guests serve most tests; the faults boot two more. The pytest process is made a
subreaper, as feosd is, so that a killed service's QEMUs become its children.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import feos.rpc
from feos.errors import Code, FeosError
from feos.vmm import _cgroup
from feos.vmm._driver import VmSpec, VmState
from feos.vmm._qemu import QemuDriver, _is_ours
from feos.vmm._service import Crashed, GuestAttached, MicroVms, Stopped, Suspended, newest_guest

A, B, C = "aaaaaaaaaaa", "bbbbbbbbbbb", "ccccccccccc"
GUESTS = Path(os.environ.get("FEOS_GUEST_DIR", "/usr/lib/feos/guest"))
PR_SET_CHILD_SUBREAPER = 36


@attrs.frozen
class Env:
    state: Path
    disks: Path
    cgroups: Any

    def service(self, bridge: Any, **kw: Any) -> MicroVms:
        kw.setdefault("attach_timeout", 60)
        return MicroVms(self.state, self.state / "run", bridge, accel="tcg", cgroups=self.cgroups,
                        **kw)  # fmt: skip

    def disk(self, vm_id: str) -> str:
        path = self.disks / f"{vm_id}.img"
        if not path.exists():
            _, gdir = newest_guest(GUESTS)
            subprocess.run(["zstd", "-q", "-d", "-f", "--sparse", str(gdir / "data.img.zst"),
                            "-o", str(path)], check=True)  # fmt: skip
        return str(path)

    def spec(self, vm_id: str, **kw: object) -> VmSpec:
        return VmSpec(vcpus=1, memory_mib=512, data_disk=self.disk(vm_id), **kw)  # type: ignore[arg-type]

    def pid(self, vm_id: str) -> int:
        return int((self.state / "vms" / "qemu" / vm_id / "qemu.pid").read_text())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.fail("the QEMU tests need root (TAP-free, but chroot, runas and cgroups do)")
    try:
        newest_guest(GUESTS)
    except FeosError as exc:
        pytest.fail(f"no guest installed: {exc.message} (run hack/guest-image)")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = tmp_path_factory.mktemp("vmm")
    e = Env(root / "state", root / "disks", _cgroup.detect())
    e.state.mkdir()
    e.disks.mkdir()
    try:
        yield e
    finally:
        _kill_all(e.state)
        for vm_id in (A, B, C):
            _cgroup.remove(e.cgroups, vm_id)


def _kill_all(state: Path) -> None:
    """Every QEMU this module started, by the pid its directory names."""
    for d in (state / "vms" / "qemu").glob("*"):
        try:
            pid = int((d / "qemu.pid").read_text())
        except (OSError, ValueError):
            continue
        if _is_ours(pid, d.name, d):
            os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.fixture
async def vms(env: Env, prepared: None) -> AsyncIterator[MicroVms]:
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as inner:
        service = await inner.start(env.service(bridge).run)
        yield service
        inner.cancel_scope.cancel()


async def _prepare(env: Env, wanted: dict[str, VmState]) -> None:
    """The module's guests as a test needs them, whatever the tests before it left (each test
    passes alone): made and started, resumed, or shut down (STOPPED: any state that is not
    running, created included, as `start` boots each alike); by a service of its own that lets
    go of them at its end, for the test's own service (or its takeover) to find."""
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge).run)
        for vm_id, state in wanted.items():
            try:
                info = vms.get(vm_id)
            except FeosError as e:
                if e.code != Code.NOT_FOUND:
                    raise
                info = await vms.create(vm_id, env.spec(vm_id))
            if info.state is VmState.SUSPENDED:
                await vms.resume(vm_id)
            down = (VmState.CREATED, VmState.STOPPED, VmState.CRASHED)
            if state is VmState.RUNNING and vms.get(vm_id).state in down:
                await vms.start(vm_id)
            if state is VmState.STOPPED and vms.get(vm_id).state is VmState.RUNNING:
                await vms.shutdown(vm_id)
            assert vms.get(vm_id).state in ((state,) if state is VmState.RUNNING else down)
        n.cancel_scope.cancel()


def guests(wanted: dict[str, VmState]) -> pytest.MarkDecorator:
    """The states of the module's guests a test needs (the fixture `prepared` makes them)."""
    return pytest.mark.guests(wanted)


@pytest.fixture
async def prepared(env: Env, request: pytest.FixtureRequest) -> None:
    """The guests the test's `guests` mark asks for, before its own service starts: `vms`
    depends on this fixture, as pytest-trio sets independent async fixtures up concurrently."""
    mark = request.node.get_closest_marker("guests")
    if mark is not None:
        await _prepare(env, mark.args[0])


async def _events(recv: trio.MemoryReceiveChannel[object], within: float = 0.2) -> list[object]:
    out = []
    while True:
        with trio.move_on_after(within):
            out.append(await recv.receive())
            continue
        return out


# -- the tests share the module's two guests; a fixture prepares what a test needs ------------


async def test_create_start_attach_and_clock(env: Env, vms: MicroVms) -> None:
    events = vms.subscribe()
    for vm_id in (A, B):
        info = await vms.create(vm_id, env.spec(vm_id))
        assert info.state is VmState.CREATED
        assert info.accel == "tcg"
        config = json.loads((env.state / "vms" / "qemu" / vm_id / "config").read_text())
        assert "tsc_early_khz=" in " ".join(config)
        assert "-chroot" in config
    async with trio.open_nursery() as n:
        for vm_id in (A, B):
            n.start_soon(vms.start, vm_id)
    for vm_id in (A, B):
        info = vms.get(vm_id)
        assert info.state is VmState.RUNNING
        assert info.attached
        guest = await vms.guest(vm_id)
        before = time.time_ns()
        guest_ns = await guest.get_time()
        assert abs(guest_ns - before) < 2_000_000_000  # the wall time was pushed at attach
        d = env.state / "vms" / "qemu" / vm_id
        assert Path(f"/proc/{env.pid(vm_id)}/root").resolve() == d  # QEMU is chrooted
        assert os.stat(f"/proc/{env.pid(vm_id)}").st_uid >= 2_000_000  # as its own user
        for cg in _cgroup.vm_dirs(env.cgroups, vm_id):  # its own cgroup, 100 a vCPU
            assert env.pid(vm_id) in _cgroup.pids_in(cg)
        weights = [_cgroup.weight_of(1), _cgroup.shares_of(1)]
        cpu = next(d for d in _cgroup.vm_dirs(env.cgroups, vm_id) if "cpu" in d.parts)
        assert any(int((cpu / f).read_text()) in weights
                   for f in ("cpu.weight", "cpu.shares") if (cpu / f).exists())  # fmt: skip
    got = await _events(events)
    assert {e.id for e in got if isinstance(e, GuestAttached)} == {A, B}  # type: ignore[attr-defined]


@guests({A: VmState.RUNNING})
async def test_suspend_keeps_the_guest_and_resume_brings_it_back(env: Env, vms: MicroVms) -> None:
    assert vms.get(A).state is VmState.RUNNING  # taken over from the fixture's service
    guest = await vms.guest(A)
    ping = await guest.ping()
    events = vms.subscribe()
    started = time.monotonic()
    info = await vms.suspend(A)
    assert info.state is VmState.SUSPENDED
    memory = env.state / "vms" / "qemu" / A / "snapshot" / "memory"
    st = os.stat(memory)
    assert st.st_size > 0
    assert st.st_blocks * 512 < 512 << 20  # the zero pages are not in the snapshot
    assert not Path(f"/proc/{env.pid(A)}").exists() or not _is_ours(env.pid(A), A, memory.parent.parent)
    await trio.sleep(1)
    info = await vms.resume(A)
    assert info.state is VmState.RUNNING
    assert not memory.exists()
    resumed = await vms.guest(A)
    again = await resumed.ping()
    assert again.boot_id == ping.boot_id  # the same boot: memory came back, no reboot
    away_ns = int((time.monotonic() - started) * 1e9)
    assert ping.uptime_ns < again.uptime_ns < ping.uptime_ns + away_ns - 500_000_000
    assert Suspended(A) in await _events(events)
    # The Cap'n Proto session went on across the VMM's restart: the same client, and the
    # guest's console (serial.log, new with the resumed QEMU) shows no new hello.
    assert resumed.client is guest.client
    serial = (env.state / "vms" / "qemu" / A / "serial.log").read_text(errors="replace")
    assert "hello sent" not in serial, serial[-2000:]
    # A call made while the VM is suspended waits in the kept session and is answered after
    # the resume.
    await vms.suspend(A, purge_guest=False)
    answers: list[Any] = []
    answered = trio.Event()

    async def ping_while_suspended() -> None:
        answers.append(await resumed.ping())
        answered.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping_while_suspended)
        await trio.sleep(0.5)
        assert answers == []
        await vms.resume(A)
        with trio.fail_after(10):
            await answered.wait()
    assert answers[0].uptime_ns > again.uptime_ns
    assert (await vms.guest(A)).client is guest.client


@guests({A: VmState.RUNNING})
async def test_the_guest_comes_back_after_the_link_drops(env: Env, vms: MicroVms) -> None:
    """The node's end of the link closes (as when feosd dies): the agent notices, and the
    link's next dial gets a new session of the same boot."""
    guest = await vms.guest(A)
    before = await guest.ping()
    await guest.call(guest.client.close)
    with trio.fail_after(30):
        again = await vms.guest(A, within=30)
        while again.client is guest.client:  # the link has not seen its session end yet
            await trio.sleep(0.05)
            again = await vms.guest(A, within=30)
    assert again.client.session != guest.client.session
    assert (await again.ping()).boot_id == before.boot_id


@guests({A: VmState.RUNNING, B: VmState.RUNNING})
async def test_takeover_after_kill_9(env: Env, prepared: None) -> None:
    """A service in a process of its own suspends B, and dies by SIGKILL; a new one finds A
    running (the same QEMU) and B suspended, and resumes B."""
    pid_a = env.pid(A)
    script = f"""
import sys, trio, feos.rpc
from pathlib import Path
from typing import Any
from feos.vmm._service import MicroVms
async def main():
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(MicroVms(Path({str(env.state)!r}), Path("/tmp"), bridge, accel="tcg").run)
        await vms.suspend({B!r})
        print("READY", vms.get({A!r}).state.value, vms.get({B!r}).state.value, flush=True)
        await trio.sleep_forever()
trio.run(main)
"""
    proc = await trio.lowlevel.open_process([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        out = b""
        with trio.fail_after(120):
            while b"\n" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the service in its own process ended early"
                out += chunk
        assert out.split() == [b"READY", b"running", b"suspended"]
    finally:
        proc.kill()  # SIGKILL: the service has no chance to let go of anything
        await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge).run)
        assert vms.get(A).state is VmState.RUNNING
        assert env.pid(A) == pid_a  # not restarted
        assert vms.get(B).state is VmState.SUSPENDED
        await (await vms.guest(A)).ping()
        assert (await vms.resume(B)).state is VmState.RUNNING
        await (await vms.guest(B)).ping()
        n.cancel_scope.cancel()


@guests({B: VmState.RUNNING})
async def test_late_snapshot_is_busy_across_a_restart_then_runs_again(
    env: Env, prepared: None
) -> None:
    """A snapshot past its timeout: busy, refused, the marker kept across a restart of the
    service, and once QEMU is done the VM runs again with the snapshot discarded."""
    d = env.state / "vms" / "qemu" / B
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        slow = QemuDriver(env.state, max_bandwidth=8 << 20)  # 8 MiB/s: seconds of snapshot
        vms = await n.start(env.service(bridge, driver=slow, snapshot_timeout=0.3).run)
        with pytest.raises(FeosError) as e:
            await vms.suspend(B, purge_guest=False)
        assert e.value.code == Code.UNAVAILABLE
        assert e.value.busy
        assert (d / "late-snapshot").exists()
        assert vms.get(B).state is VmState.BUSY
        for call in (vms.suspend, vms.shutdown):
            with pytest.raises(FeosError) as e:
                await call(B)
            assert e.value.busy
        with pytest.raises(FeosError) as e:
            await vms.guest(B, within=0.5)
        assert e.value.busy
        assert "the VM is busy" in e.value.message
        n.cancel_scope.cancel()  # feosd goes away while QEMU writes on
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge).run)
        assert vms.get(B).state is VmState.BUSY  # the marker said so
        with trio.fail_after(90):
            while vms.get(B).state is not VmState.RUNNING:  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert not (d / "late-snapshot").exists()
        assert not (d / "snapshot" / "memory.part").exists()
        await (await vms.guest(B)).ping()
        n.cancel_scope.cancel()


@guests({A: VmState.RUNNING, B: VmState.RUNNING})
async def test_shutdown_is_stopped_and_a_killed_qemu_crashed(env: Env, vms: MicroVms) -> None:
    events = vms.subscribe()
    info = await vms.shutdown(A)
    assert info.state is VmState.STOPPED
    os.kill(env.pid(B), signal.SIGKILL)
    with trio.fail_after(10):
        while vms.get(B).state is not VmState.CRASHED:  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert vms.get(B).reason == "QEMU was killed by signal 9"
    got = await _events(events)
    assert any(isinstance(e, Stopped) and e.id == A for e in got)
    assert Crashed(B, "QEMU was killed by signal 9") in got


@guests({A: VmState.STOPPED})
async def test_a_qmp_that_does_not_answer_after_a_restart(env: Env, prepared: None) -> None:
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge).run)
        await vms.start(A)  # a stopped VM boots again
        pid = env.pid(A)
        n.cancel_scope.cancel()
    os.kill(pid, signal.SIGSTOP)  # QEMU's socket accepts, but nothing answers
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge).run)
        info = vms.get(A)
        assert info.state is VmState.CRASHED
        assert "did not answer" in info.reason
        assert not _is_ours(pid, A, env.state / "vms" / "qemu" / A)
        n.cancel_scope.cancel()


async def test_a_guest_that_never_attaches(env: Env) -> None:
    async with feos.rpc.capnp_thread() as bridge, trio.open_nursery() as n:
        vms = await n.start(env.service(bridge, attach_timeout=6).run)
        # The initramfs's shell as init: it waits on the console and never runs the agent.
        await vms.create(C, env.spec(C, kernel_extra=("rdinit=/bin/sh",)))
        with pytest.raises(FeosError) as e:
            await vms.start(C)
        assert e.value.code == Code.UNAVAILABLE
        info = vms.get(C)
        assert info.state is VmState.CRASHED
        assert info.reason == "the guest did not attach within 6s"
        n.cancel_scope.cancel()


@guests({A: VmState.RUNNING})
async def test_delete_removes_everything(env: Env, vms: MicroVms) -> None:
    disk = Path(env.disk(A))
    for vm_id in [v.id for v in vms.list()]:
        await vms.delete(vm_id)
    assert vms.list() == []
    assert list((env.state / "vms" / "qemu").iterdir()) == []
    assert os.stat(disk).st_uid == 0  # the disk's owner given back
    assert not any(d.exists() for v in (A, B, C) for d in _cgroup.vm_dirs(env.cgroups, v))
    with pytest.raises(FeosError) as e:
        vms.get(A)
    assert e.value.code == Code.NOT_FOUND
