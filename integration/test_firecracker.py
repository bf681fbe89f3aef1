"""Firecracker v1.12.1 in its jailer, for real: jailed in a throwaway state directory, configured
through its API, started, paused, snapshotted, resumed from the snapshot, deleted without a trace.

This host's /dev/kvm is PVM, on which stock guest kernels cannot finish booting (environment.md),
so the microVM here runs a tiny guest of its own: an ELF kernel of a few instructions that writes
"FEOS-TINY" to the serial port and halts. That boots on any KVM, PVM too, and shows Firecracker
really ran the vCPU (its serial output lands in serial.log). Only the test that boots the real
guest needs a KVM that runs stock kernels, and skips with the probe's reason where it cannot.
"""

# ruff: noqa: ASYNC110
# (serial.log is polled with a deadline: the guest writes it, nothing to wait on)
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import fc_pattern
import pytest
import trio
from fc_pattern import TINY_TEXT, VERSION, tiny_kernel

from feos.errors import FeosError
from feos.vmm import _cgroup as cg
from feos.vmm import _jail, _kvm
from feos.vmm._driver import VmHandle, VmSpec, VmState
from feos.vmm._firecracker import FirecrackerDriver

CGROUPS = Path("/sys/fs/cgroup")


def _text(path: str | Path) -> str:
    """A small read of /proc or a jail's file (sync: tests read them in place)."""
    return Path(path).read_text()


def _exists(path: str | Path) -> bool:
    return Path(path).exists()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


@pytest.fixture(scope="module")
def firecracker_root() -> Path:
    return fc_pattern.firecracker_root()


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    """A directory on another filesystem than the state's: its files go in by bind mount."""
    d = Path("/dev/shm") / f"feostest-fc-{secrets.token_hex(3)}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def guest_dir(shm_dir: Path) -> Path:
    g = shm_dir / "guest"
    g.mkdir()
    (g / "vmlinux").write_bytes(tiny_kernel())
    with open(g / "root.erofs", "wb") as f:
        f.truncate(1 << 20)
    return g


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    name = f"feostest-fc-{secrets.token_hex(3)}"
    _run("ip", "netns", "add", name)
    yield name
    _run("ip", "netns", "delete", name, check=False)


@pytest.fixture(scope="module")
def cgroup_parents() -> Iterator[dict[str, Path]]:
    with fc_pattern.cgroup_parents() as bases:
        yield bases


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("feos-state")


def _handle(driver: FirecrackerDriver, vm_id: str, guest: Path, data: Path,
            volume: Path) -> VmHandle:
    spec = VmSpec(vcpus=2, memory_mib=128, data_disk=str(data), volumes=(str(volume),),
                  tap=f"fct{secrets.token_hex(3)}", mac="06:00:aa:bb:cc:dd",
                  metadata=json.dumps({"feos": {"pod-id": vm_id}}))
    return VmHandle(id=vm_id, spec=spec, directory=driver.directory(vm_id), guest_version="tiny",
                    guest_dir=guest, accel="kvm")


async def _boot(driver: FirecrackerDriver, vm: VmHandle) -> None:
    await driver.prepare(vm)
    await driver.start(vm, within=10)


@pytest.fixture(scope="module")
def booted(firecracker_root: Path, state_dir: Path, guest_dir: Path, shm_dir: Path,
           netns: str, cgroup_parents: dict[str, Path]
           ) -> Iterator[tuple[FirecrackerDriver, VmHandle]]:
    """One microVM, started: shared by the module's tests (each its own trio run, as pytest-trio
    wants a module's fixtures synchronous), deleted at the end."""
    driver = FirecrackerDriver(state_dir, cgroups=cg.V1Layout(bases=cgroup_parents),
                               netns=netns, tsc_khz=2596144)
    data = state_dir / "disk.img"
    with open(data, "wb") as f:
        f.truncate(8 << 20)
    volume = shm_dir / "volume.img"
    with open(volume, "wb") as f:
        f.truncate(8 << 20)
    vm = _handle(driver, f"fct-{secrets.token_hex(4)}", guest_dir, data, volume)
    try:
        trio.run(_boot, driver, vm)
        yield driver, vm
    finally:
        trio.run(driver.delete, vm)


async def _serial(driver: FirecrackerDriver, vm: VmHandle, text: bytes, within: float) -> None:
    with trio.fail_after(within):
        while text not in (driver.directory(vm.id) / "serial.log").read_bytes():
            await trio.sleep(0.02)


async def test_started_in_the_jail(booted: tuple[FirecrackerDriver, VmHandle],
                                   cgroup_parents: dict[str, Path]) -> None:
    driver, vm = booted
    root = driver.directory(vm.id)
    record = driver.jail(vm.id).read()
    assert record is not None
    assert record.version == VERSION
    assert record.uid >= _jail.UID_BASE
    info = await driver.api(vm.id).describe()
    assert (info["state"], info["vmm_version"]) == ("Running", "1.12.1")
    await _serial(driver, vm, TINY_TEXT, 10)  # the vCPU ran the tiny guest
    pid = int((root / "firecracker.pid").read_text())
    status = _text(f"/proc/{pid}/status")
    assert f"Uid:\t{record.uid}\t" in status
    assert os.getsid(pid) == pid != os.getsid(0)  # a session of its own, not feosd's
    # chrooted into root/ (pivot_root), in a mount namespace of its own
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert _text(f"/proc/{pid}/root/config.json") == _text(root / "config.json")
    seen = cg.parse_proc_cgroup(_text(f"/proc/{pid}/cgroup"))
    for h, base in cgroup_parents.items():
        assert seen[h] == f"/{base.name}/vms/{vm.id}"
    assert (cgroup_parents["cpu"] / "vms" / vm.id / "cpu.shares").read_text().strip() == "2048"


async def test_the_jail_holds_the_spec_table(booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    root = driver.directory(vm.id)
    for name in ("config.json", "fc.sock", "v.sock", "serial.log", "vmm.log", "metadata.json",
                 "vmlinux", "root.erofs", "data", "volume1", "snapshot", "firecracker"):
        assert (root / name).exists(), name
    assert (root / "console.in").is_fifo()
    record = driver.jail(vm.id).read()
    assert record is not None
    how = {link.name: link.how for link in record.links}
    # the state's disk is on root/'s filesystem, the guest's files and the volume are not
    assert how == {"vmlinux": "bind", "root.erofs": "bind", "data": "hardlink",
                   "volume1": "bind"}
    assert os.stat(root / "data").st_uid == record.uid
    config = json.loads((root / "config.json").read_text())
    assert "feos.link=vsock" in config["boot-source"]["boot_args"]
    assert record.taps == [vm.spec.tap]
    assert "Running Firecracker v1.12.1" in (root / "vmm.log").read_text()


async def test_mmds_holds_the_metadata(booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    got = (await driver.api(vm.id).call("GET", "/mmds")).json()
    assert got == {"feos": {"pod-id": vm.id}}


async def test_balloon_statistics_answer(booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    # the tiny guest has no balloon driver, so its statistics are Firecracker's side alone
    stats = await driver.balloon_statistics(vm)
    print("balloon statistics:", stats)
    assert stats["target_pages"] == 0
    assert stats["actual_pages"] == 0


async def test_pause_snapshot_resume(booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    root = driver.directory(vm.id)
    await driver.api(vm.id).pause()
    assert (await driver.api(vm.id).describe())["state"] == "Paused"
    await driver.api(vm.id).resume()
    await driver.suspend(vm, snapshot_timeout=60)
    assert await driver.state(vm) == VmState.SUSPENDED
    memory = root / "snapshot" / "memory"
    st = memory.stat()
    assert st.st_size == 128 << 20
    assert st.st_blocks * 512 < st.st_size // 4  # the zero pages were punched out
    # a restore runs the snapshot's Firecracker, or fails when it is not installed any more
    jail = driver.jail(vm.id)
    record = jail.read()
    assert record is not None
    jail.write(attrs.evolve(record, version="v0.0.1"))
    with pytest.raises(FeosError, match=r"v0\.0\.1, which is not installed") as e:
        await driver.resume(vm, within=10)
    assert e.value.code.name == "FAILED_PRECONDITION"
    jail.write(record)
    await driver.resume(vm, within=10)
    assert (await driver.api(vm.id).describe())["state"] == "Running"
    assert not memory.exists()
    assert (await driver.api(vm.id).call("GET", "/mmds")).json() == {"feos": {"pod-id": vm.id}}


async def test_late_snapshot_refuses_then_runs_on(
        booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    with pytest.raises(FeosError) as e:
        await driver.suspend(vm, snapshot_timeout=0.0005)
    assert e.value.busy
    assert "Firecracker still writes the snapshot" in e.value.message
    assert driver.late_snapshot(vm)
    with pytest.raises(FeosError, match="still writes the snapshot") as again:
        await driver.shutdown(vm, grace=1)
    assert again.value.busy
    with trio.fail_after(30):
        await driver.late_snapshot_done(vm)
    assert not driver.late_snapshot(vm)
    assert (await driver.api(vm.id).describe())["state"] == "Running"


async def test_a_new_feosd_adopts_it(booted: tuple[FirecrackerDriver, VmHandle],
                                    cgroup_parents: dict[str, Path]) -> None:
    driver, vm = booted
    fresh = FirecrackerDriver(driver.state_dir, cgroups=cg.V1Layout(bases=cgroup_parents))
    adopted = await fresh.adopt(vm)
    assert adopted.state == VmState.RUNNING
    assert adopted.pid == int((driver.directory(vm.id) / "firecracker.pid").read_text())


async def test_shutdown_of_a_guest_that_ignores_it(
        booted: tuple[FirecrackerDriver, VmHandle]) -> None:
    driver, vm = booted
    # the tiny guest has no keyboard controller driver: Ctrl-Alt-Del goes unheard
    ended = await driver.shutdown(vm, grace=0.5)
    assert ended.state == VmState.CRASHED
    assert "did not power off within 0.5s" in ended.reason
    assert await driver.state(vm) == VmState.CREATED


async def test_delete_leaves_nothing(firecracker_root: Path, state_dir: Path, guest_dir: Path,
                                     shm_dir: Path, netns: str) -> None:
    """A second microVM whose cgroups are not at one path in every hierarchy: feosd moves
    Firecracker itself. Its delete undoes everything."""
    name = secrets.token_hex(3)
    bases = {"cpu": CGROUPS / "cpu" / f"feostest-a{name}",
             "pids": CGROUPS / "pids" / f"feostest-b{name}"}
    for d in bases.values():
        d.mkdir()
    try:
        driver = FirecrackerDriver(state_dir, cgroups=cg.V1Layout(bases=bases), netns=netns)
        disk = state_dir / "disk2.img"
        disk.write_bytes(b"\0" * 4096)
        owner = (disk.stat().st_uid, disk.stat().st_gid)
        volume = shm_dir / "volume2.img"
        volume.write_bytes(b"\0" * 4096)
        vm = _handle(driver, f"fcd-{secrets.token_hex(4)}", guest_dir, disk, volume)
        await driver.prepare(vm)
        await driver.start(vm, within=10)
        pid = int((driver.directory(vm.id) / "firecracker.pid").read_text())
        seen = cg.parse_proc_cgroup(_text(f"/proc/{pid}/cgroup"))
        assert seen["cpu"] == f"/{bases['cpu'].name}/vms/{vm.id}"
        assert seen["pids"] == f"/{bases['pids'].name}/vms/{vm.id}"
        await driver.delete(vm)
        assert not _exists(f"/proc/{pid}")  # gone, and reaped
        assert not driver.jail(vm.id).dir.exists()
        assert not any((b / "vms" / vm.id).exists() for b in bases.values())
        assert _run("ip", "-n", netns, "link", "show", vm.spec.tap or "", check=False).returncode
        assert (disk.stat().st_uid, disk.stat().st_gid) == owner
        assert vm.id not in _text("/proc/self/mountinfo")
        await driver.delete(vm)  # again: nothing left to do
    finally:
        for d in bases.values():
            vms = d / "vms"
            for sub in vms.glob("*") if vms.exists() else ():
                if sub.is_dir():
                    sub.rmdir()
            if vms.exists():
                vms.rmdir()
            d.rmdir()


async def test_restore_needs_the_snapshot_version(state_dir: Path) -> None:
    with pytest.raises(FeosError, match=r"v0\.0\.1, which is not installed") as e:
        _jail.find("v0.0.1")
    assert e.value.code.name == "FAILED_PRECONDITION"


def test_kvm_probe_sees_what_this_host_is(tmp_path: Path) -> None:
    answer = _kvm.kvm_probe(tmp_path / "probe")
    assert _kvm.kvm_probe(tmp_path / "probe") == answer  # cached for this boot
    if Path("/sys/module/kvm_pvm").exists():
        assert not answer.usable
        assert answer.reason
    if Path("/dev/kvm").exists():
        assert _kvm.tiny_guest() == "io K, hlt"


def _installed_guest() -> Path | None:
    root = Path(os.environ.get("FEOS_GUEST_DIR", "/usr/lib/feos/guest"))
    found = [d for d in root.glob("*") if (d / "vmlinux").exists() and (d / "initramfs").exists()]
    return max(found, key=lambda d: d.stat().st_mtime, default=None)


def test_real_guest_reaches_init(firecracker_root: Path, tmp_path: Path,
                                 cgroup_parents: dict[str, Path]) -> None:
    # synchronous, so that the skip keeps its reason (a trio test's skip loses it)
    answer = _kvm.kvm_probe()
    if not answer.usable:
        pytest.skip(f"/dev/kvm cannot really run a guest here: {answer.reason}; so no Debian "
                    "guest boots under Firecracker, and its pod path is tested with the tiny "
                    "test kernel only (test_microvms_run_a_pod_under_firecracker)")
    guest = _installed_guest()
    assert guest is not None, "no guest installed (packaging/guest builds one)"
    driver = FirecrackerDriver(tmp_path, cgroups=cg.V1Layout(bases=cgroup_parents))
    vm_id = f"fcg-{secrets.token_hex(4)}"
    vm = VmHandle(id=vm_id, spec=VmSpec(vcpus=1, memory_mib=512),
                  directory=driver.directory(vm_id), guest_version=guest.name, guest_dir=guest)

    async def boot() -> None:
        await driver.prepare(vm)
        try:
            await driver.start(vm, within=10)
            await _serial(driver, vm, b"Run /init as init process", 30)
        finally:
            await driver.delete(vm)

    trio.run(boot)


# -- a pod's path through the microVM service with Firecracker ---------------------------------
# The service (MicroVms) as feosd runs it when the node's VMM is Firecracker: create, start, the
# API socket, the guest's uplink listener on vsock, MMDS, suspend and resume, and the takeover
# by a service whose own choice is QEMU. The tiny kernel has no agent, so nothing attaches: the
# guest's part (its attach, its calls) cannot run here, where stock guest kernels cannot boot
# under Firecracker (PVM), and is not tested.

_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def _pod_id() -> str:
    return "f" + "".join(secrets.choice(_CROCKFORD) for _ in range(10))


@pytest.fixture(scope="module")
def tiny_guests(shm_dir: Path) -> Path:
    """An installed-guest directory whose only version is the tiny kernel."""
    g = shm_dir / "guests" / "tiny"
    g.mkdir(parents=True)
    (g / "manifest.json").write_text(json.dumps({"version": "tiny", "built": "1"}))
    (g / "vmlinux").write_bytes(tiny_kernel())
    with open(g / "root.erofs", "wb") as f:
        f.truncate(1 << 20)
    return shm_dir / "guests"


def _connect_via_dir(path: Path) -> socket.socket:
    """Connect to a Unix socket whatever the depth of its directory (as Firecracker, chrooted,
    connects to v.sock_10001 by a short path)."""
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
    return sock


async def test_microvms_run_a_pod_under_firecracker(
        firecracker_root: Path, tiny_guests: Path, netns: str, shm_dir: Path,
        cgroup_parents: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from feos.rpc import capnp_thread
    from feos.vmm import _service
    from feos.vmm._choice import VmmChoice
    from feos.vmm._qemu import QemuDriver
    from feos.vmm._service import MicroVms

    monkeypatch.setattr(_service, "RESUME_PING_S", 0.2)  # no agent answers the resume's ping
    state = tmp_path_factory.mktemp("feos-fcpod")
    layout = cg.V1Layout(bases=cgroup_parents)

    def firecracker() -> FirecrackerDriver:
        return FirecrackerDriver(state, cgroups=layout, netns=netns, tsc_khz=2596144)

    pod = _pod_id()
    metadata = {"feos": {"pod-id": pod}, "metadata": {"team": "fc"}}
    data = state / "pod-disk.img"
    data.touch()
    os.truncate(data, 8 << 20)
    spec = VmSpec(vcpus=1, memory_mib=128, data_disk=str(data), tap=f"fcp{secrets.token_hex(3)}",
                  mac="06:00:aa:bb:cc:01", metadata=json.dumps(metadata))
    fc_choice = VmmChoice("firecracker", "kvm", "the test's", "firecracker")
    qemu_choice = VmmChoice("qemu", "tcg", "the test's", "qemu")
    async with capnp_thread() as bridge:
        vms = MicroVms(state, state / "run", bridge, drivers={"firecracker": firecracker()},
                       choice=fc_choice, guest_dir=tiny_guests)
        async with trio.open_nursery() as n:
            await n.start(vms.run)
            info = await vms.create(pod, spec)
            assert (info.driver, info.accel, info.state) == ("firecracker", "kvm",
                                                             VmState.CREATED)
            try:
                await _pod_under_firecracker(vms, firecracker(), pod, metadata)
            except BaseException:
                with trio.CancelScope(shield=True), trio.move_on_after(30):
                    await firecracker().delete(_vm_of(firecracker(), pod))
                raise
            n.cancel_scope.cancel()  # feosd stops: the microVM runs on
        # A feosd whose own choice is QEMU takes the running Firecracker microVM over, and
        # keeps it under Firecracker.
        again = MicroVms(state, state / "run", bridge, guest_dir=tiny_guests, choice=qemu_choice,
                         drivers={"firecracker": firecracker(), "qemu": QemuDriver(state)})
        async with trio.open_nursery() as n:
            await n.start(again.run)
            try:
                got = again.get(pod)
                assert (got.driver, got.state) == ("firecracker", VmState.RUNNING)
                assert again.driver_for(pod) == "firecracker"
                assert again.driver_for(_pod_id()) == "qemu"  # a new pod would boot QEMU
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(30):
                    await again.delete(pod)
            n.cancel_scope.cancel()
    assert not FirecrackerDriver(state).jail(pod).dir.exists()


async def _pod_under_firecracker(vms: Any, driver: FirecrackerDriver, pod: str,
                                 metadata: dict[str, Any]) -> None:
    info = await vms.start(pod, wait_attach=False)
    assert info.state is VmState.RUNNING
    root = driver.directory(pod)
    # the API socket answers: Firecracker runs the microVM, the vCPU ran the tiny guest
    assert (await driver.api(pod).describe())["state"] == "Running"
    await _serial(driver, _vm_of(driver, pod), TINY_TEXT, 10)
    assert stat.S_ISSOCK(os.stat(root / "v.sock").st_mode)  # the vsock device's socket
    # the guest's uplink: the node listens on v.sock_10001, which the jailed user may dial
    record = driver.jail(pod).read()
    assert record is not None
    uplink = os.stat(root / "v.sock_10001")
    assert stat.S_ISSOCK(uplink.st_mode) and uplink.st_uid == record.uid
    with _connect_via_dir(root / "v.sock_10001") as guest:
        # the guest link took the connection: no hello within a second, so the node pokes
        guest.settimeout(15)
        poke = await trio.to_thread.run_sync(guest.recv, 256)
        assert poke.startswith(b"FEOS-NODE 1 ")
    # MMDS holds the pod's metadata
    assert (await driver.api(pod).call("GET", "/mmds")).json() == metadata
    # suspend and resume through the service: the snapshot, then MMDS put back
    info = await vms.suspend(pod, purge_guest=False)
    assert info.state is VmState.SUSPENDED
    assert (root / "snapshot" / "memory").exists()
    assert vms.driver_for(pod) == "firecracker"
    info = await vms.resume(pod)
    assert (info.state, info.driver) == (VmState.RUNNING, "firecracker")
    assert (await driver.api(pod).describe())["state"] == "Running"
    assert (await driver.api(pod).call("GET", "/mmds")).json() == metadata
    assert not (root / "snapshot" / "memory").exists()


def _vm_of(driver: FirecrackerDriver, pod: str) -> VmHandle:
    return VmHandle(id=pod, spec=VmSpec(), directory=driver.directory(pod), guest_version="tiny",
                    guest_dir=Path("/"))


def test_feosd_refuses_firecracker_where_it_cannot_run(tmp_path: Path) -> None:
    """--vmm firecracker fails feosd's start with one line naming why (here: PVM)."""
    answer = _kvm.kvm_probe()
    if answer.usable:
        pytest.skip("KVM runs guests here: whether Firecracker runs depends on its own probe")
    done = subprocess.run([str(Path(sys.executable).parent / "feosd"), "--vmm", "firecracker",
                           "--state-dir", str(tmp_path / "state"), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"feosd: --vmm firecracker: Firecracker cannot run here: KVM cannot run a " \
                   f"guest: {answer.reason}"
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "api.sock").exists()


@pytest.mark.parametrize("vmm", ["auto", "qemu"])
def test_host_info_says_which_vmm_and_why(feosd_factory: Any, vmm: str) -> None:
    """feosd's choice in `feosctl host info` and in its log; here QEMU, on TCG where KVM cannot
    run a guest (the auto choice's Firecracker branch needs a KVM that boots the guest)."""
    answer = _kvm.kvm_probe()
    daemon = feosd_factory("--vmm", vmm).start()
    info = daemon.ctl_json("host", "info")
    accel = "kvm" if answer.usable else "tcg"
    got = info["vmm"]
    assert (got["driver"], got["requested"]) == ("qemu", vmm) or answer.usable
    assert got["accel"] == accel
    if not answer.usable:
        why = f"no KVM: {answer.reason}"
        assert got["reason"] == (f"--vmm qemu; {why}" if vmm == "qemu" else
                                 f"Firecracker cannot run: KVM cannot run a guest: "
                                 f"{answer.reason}; {why}")
    assert info["version"]["driver"] == got["driver"]
    table = daemon.ctl("host", "info").stdout
    assert f"QEMU under {accel.upper()}" in table or answer.usable
    assert f"the pods' VMM: {'QEMU' if not answer.usable else ''}" in daemon.log_text()


def test_firecracker_opens_diskds_fuse_export_as_its_own_user(
        firecracker_root: Path, state_dir: Path, guest_dir: Path, shm_dir: Path, netns: str,
        cgroup_parents: dict[str, Path], tmp_path: Path) -> None:
    """The data disk is diskd's raw FUSE export of a qcow2 chain: the jail binds it into the
    chroot and gives it to the microVM's user, and Firecracker, as that user, opens it."""
    from diskd_proc import DiskdProc

    with DiskdProc(tmp_path / "disk").start() as diskd:
        diskd.call("createDisk", id="fcdisk", kind="pod", sizeBytes=8 << 20)
        data = Path(diskd.call("startDisk", id="fcdisk", vmm="firecracker",
                               ownerUid=0)["disk"]["path"])
        driver = FirecrackerDriver(state_dir, cgroups=cg.V1Layout(bases=cgroup_parents),
                                   netns=netns, tsc_khz=2596144)
        volume = shm_dir / "volume3.img"
        volume.write_bytes(b"\0" * 4096)
        vm = _handle(driver, f"fcx-{secrets.token_hex(4)}", guest_dir, data, volume)
        try:
            trio.run(_boot, driver, vm)
            root = driver.directory(vm.id)
            record = driver.jail(vm.id).read()
            assert record is not None
            assert [x.how for x in record.links if x.name == "data"] == ["bind"]
            assert data.stat().st_uid == record.uid  # through the bind: the FUSE file's owner
            pid = int((root / "firecracker.pid").read_text())
            opened = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            assert "/data" in opened  # inside its chroot: the bound export
        finally:
            trio.run(driver.delete, vm)
        assert data.stat().st_uid == 0  # the jail gave it back
        diskd.call("stopDisk", id="fcdisk")
