"""The microVM service with two drivers: new microVMs are made with the node's VMM, a running or
suspended one keeps its own across a restart of the service, a stopped one moves to the node's
VMM at its next start, and busy messages name the VMM of the microVM. Fake drivers, no VMM."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from feos._host import vmm_info
from feos.errors import Code, FeosError, busy
from feos.vmm import _service
from feos.vmm._choice import VmmChoice
from feos.vmm._driver import Adopted, Exit, VmHandle, VmSpec, VmState
from feos.vmm._records import Records, VmRecord
from feos.vmm._service import MicroVms

POD = "abcdefghjkm"
FC = VmmChoice("firecracker", "kvm", "fake: Firecracker boots the guest", "auto")
QEMU_TCG = VmmChoice("qemu", "tcg", "fake: no KVM", "auto")


class NoGuest:
    """A bridge to no guest: every link's dial fails, the link backs off."""

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        raise FeosError(Code.UNAVAILABLE, "no guest here")


class FakeDriver:
    def __init__(self, name: str, root: Path, adopted: Adopted | None = None) -> None:
        self.name = name
        self.root = root / name
        self.calls: list[tuple[str, str]] = []
        self.adopted = adopted or Adopted(VmState.RUNNING, "found")
        self.late = False
        self._ended: dict[str, trio.Event] = {}

    def directory(self, vm_id: str) -> Path:
        return self.root / vm_id

    def guest_link(self, vm: VmHandle) -> Path:
        return self.directory(vm.id) / "guest.sock"

    async def prepare(self, vm: VmHandle) -> None:
        self.calls.append(("prepare", vm.accel))
        vm.directory.mkdir(parents=True, exist_ok=True)

    async def start(self, vm: VmHandle, *, within: float) -> None:
        self.calls.append(("start", vm.accel))
        self._ended[vm.id] = trio.Event()

    async def wait(self, vm: VmHandle) -> Exit:
        await self._ended.setdefault(vm.id, trio.Event()).wait()
        return Exit(VmState.STOPPED, "the guest shut down")

    async def shutdown(self, vm: VmHandle, *, grace: float) -> Exit:
        self.calls.append(("shutdown", vm.accel))
        return Exit(VmState.STOPPED, "the guest shut down")

    async def suspend(self, vm: VmHandle, *, snapshot_timeout: float) -> None:
        self.calls.append(("suspend", vm.accel))
        if self.late:
            raise busy(f"{self.name} is late")

    async def late_snapshot_done(self, vm: VmHandle) -> None:
        await trio.sleep_forever()

    async def resume(self, vm: VmHandle, *, within: float, rejoin: Any = None,
                     running: Any = None) -> None:
        self.calls.append(("resume", vm.accel))

    async def delete(self, vm: VmHandle) -> None:
        self.calls.append(("delete", vm.accel))

    async def adopt(self, vm: VmHandle) -> Adopted:
        self.calls.append(("adopt", vm.accel))
        return self.adopted

    def late_snapshot(self, vm: VmHandle) -> bool:
        return False

    def pid(self, vm: VmHandle) -> int | None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def guests(tmp_path: Path) -> Path:
    g = tmp_path / "guest" / "g1"
    g.mkdir(parents=True)
    (g / "manifest.json").write_text(json.dumps({"version": "g1", "built": "1"}))
    return tmp_path / "guest"


def _record(tmp_path: Path, driver: str, state: VmState, accel: str = "tcg") -> None:
    (tmp_path / "state").mkdir(exist_ok=True)
    records = Records(tmp_path / "state" / "vms.db")
    records.put(VmRecord(POD, driver, state, "", "g1", accel, VmSpec(), 2_000_000))
    records.close()


def _drivers(tmp_path: Path, **adopted: Adopted) -> dict[str, FakeDriver]:
    return {n: FakeDriver(n, tmp_path, adopted.get(n)) for n in ("qemu", "firecracker")}


async def _service_of(nursery: trio.Nursery, tmp_path: Path, guests: Path,
                      drivers: dict[str, FakeDriver], choice: VmmChoice) -> MicroVms:
    vms = MicroVms(tmp_path / "state", tmp_path / "run", NoGuest(), drivers=drivers,
                   choice=choice, guest_dir=guests)
    started: MicroVms = await nursery.start(vms.run)
    return started


def _stored(tmp_path: Path) -> VmRecord:
    records = Records(tmp_path / "state" / "vms.db")
    try:
        (found,) = records.all()
    finally:
        records.close()
    return found


async def test_a_new_microvm_is_made_with_the_nodes_vmm(tmp_path: Path, guests: Path) -> None:
    drivers = _drivers(tmp_path)
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, FC)
        info = await vms.create(POD, VmSpec())
        assert (info.driver, info.accel) == ("firecracker", "kvm")
        assert vms.driver_for(POD) == vms.driver_for("zzzzzzzzzzz") == "firecracker"
        await vms.start(POD, wait_attach=False)
        assert drivers["firecracker"].calls == [("prepare", "kvm"), ("start", "kvm")]
        assert drivers["qemu"].calls == []
        n.cancel_scope.cancel()
    assert _stored(tmp_path).driver == "firecracker"


@pytest.mark.parametrize("state", [VmState.RUNNING, VmState.SUSPENDED])
async def test_a_running_or_suspended_qemu_vm_keeps_qemu(
        tmp_path: Path, guests: Path, state: VmState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_service, "RESUME_PING_S", 0.01)  # no guest answers the resume's ping
    _record(tmp_path, "qemu", state)
    drivers = _drivers(tmp_path, qemu=Adopted(state, "found"))
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, FC)
        assert drivers["qemu"].calls == [("adopt", "tcg")]
        assert vms.driver_for(POD) == "qemu"
        assert vms.get(POD).driver == "qemu"
        if state is VmState.SUSPENDED:
            await vms.resume(POD)
        else:
            await vms.suspend(POD, purge_guest=False)
        assert drivers["qemu"].calls[-1][0] in ("resume", "suspend")
        assert drivers["firecracker"].calls == []
        n.cancel_scope.cancel()
    assert _stored(tmp_path).driver == "qemu"


@pytest.mark.parametrize("state", [VmState.CREATED, VmState.STOPPED, VmState.CRASHED])
async def test_a_stopped_vm_boots_on_the_nodes_vmm(tmp_path: Path, guests: Path,
                                                   state: VmState) -> None:
    _record(tmp_path, "qemu", state)
    drivers = _drivers(tmp_path)
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, FC)
        assert drivers["qemu"].calls == []  # nothing to adopt: it has no process
        assert vms.driver_for(POD) == "firecracker"
        assert vms.get(POD).driver == "qemu"  # until it boots
        info = await vms.start(POD, wait_attach=False)
        assert (info.driver, info.accel, info.state) == ("firecracker", "kvm", VmState.RUNNING)
        assert drivers["qemu"].calls == [("delete", "tcg")]
        assert drivers["firecracker"].calls == [("prepare", "kvm"), ("start", "kvm")]
        n.cancel_scope.cancel()
    stored = _stored(tmp_path)
    assert (stored.driver, stored.accel, stored.uid) == ("firecracker", "kvm", 2_000_000)


async def test_a_stopped_qemu_vm_takes_the_nodes_accelerator(tmp_path: Path,
                                                             guests: Path) -> None:
    _record(tmp_path, "qemu", VmState.STOPPED, accel="tcg")
    drivers = _drivers(tmp_path)
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers,
                                VmmChoice("qemu", "kvm", "KVM works now"))
        await vms.start(POD, wait_attach=False)
        assert drivers["qemu"].calls == [("delete", "tcg"), ("prepare", "kvm"), ("start", "kvm")]
        n.cancel_scope.cancel()


async def test_a_stopped_vm_on_the_nodes_vmm_is_not_moved(tmp_path: Path, guests: Path) -> None:
    _record(tmp_path, "qemu", VmState.STOPPED)
    drivers = _drivers(tmp_path)
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, QEMU_TCG)
        await vms.start(POD, wait_attach=False)
        assert drivers["qemu"].calls == [("start", "tcg")]
        n.cancel_scope.cancel()


async def test_busy_messages_name_the_vms_vmm(tmp_path: Path, guests: Path) -> None:
    _record(tmp_path, "firecracker", VmState.BUSY, accel="kvm")
    drivers = _drivers(tmp_path, firecracker=Adopted(VmState.BUSY, "late"))
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, QEMU_TCG)
        assert vms.driver_for(POD) == "firecracker"
        with pytest.raises(FeosError) as e:
            await vms.suspend(POD)
        assert e.value.busy
        assert e.value.message == \
            f"the VM is busy: Firecracker still writes the snapshot of microVM {POD}"
        with pytest.raises(FeosError) as again:
            await vms.guest(POD, within=0.01)
        assert again.value.busy
        assert f"the VM is busy: Firecracker still writes the snapshot of microVM {POD}" \
            in again.value.message
        with pytest.raises(FeosError, match="Firecracker still writes a late snapshot"):
            await vms.start(POD)
        n.cancel_scope.cancel()


def test_the_state_tables_busy_message_names_the_vmm() -> None:
    with pytest.raises(FeosError, match="busy: QEMU still writes a late snapshot"):
        _service.next_state(VmState.BUSY, "resume", "QEMU")


async def test_a_record_of_an_unknown_driver_is_left_alone(tmp_path: Path, guests: Path) -> None:
    _record(tmp_path, "cloud-hypervisor", VmState.RUNNING)
    drivers = _drivers(tmp_path)
    async with trio.open_nursery() as n:
        vms = await _service_of(n, tmp_path, guests, drivers, QEMU_TCG)
        assert vms.list() == []
        n.cancel_scope.cancel()
    assert _stored(tmp_path).driver == "cloud-hypervisor"  # kept for a feosd that knows it


async def test_the_choice_is_made_at_the_start_when_not_given(
        tmp_path: Path, guests: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    async def choose(requested: str, state_dir: Path) -> VmmChoice:
        asked.append(requested)
        return FC

    monkeypatch.setattr(_service, "choose_vmm", choose)
    vms = MicroVms(tmp_path / "state", tmp_path / "run", NoGuest(), drivers=_drivers(tmp_path),
                   vmm="firecracker", guest_dir=guests)
    assert vms.choice is None
    async with trio.open_nursery() as n:
        await n.start(vms.run)
        assert asked == ["firecracker"]
        assert vms.choice == FC and vms.accel == "kvm"
        n.cancel_scope.cancel()


# -- the VMM probe, served around -------------------------------------------------------------


async def test_a_slow_probe_does_not_hold_the_service_and_a_create_waits_for_it(
        tmp_path: Path, guests: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: Any) -> None:
    """The service starts once QUICK_S passed without the probe's answer; meanwhile host info
    says it probes, what needs the node's VMM at once is refused UNAVAILABLE naming the probe,
    a create waits and is made with the VMM the probe then decides."""
    release = trio.Event()

    async def choose(requested: str, state_dir: Path) -> VmmChoice:
        await release.wait()
        return FC

    monkeypatch.setattr(_service, "choose_vmm", choose)
    drivers = _drivers(tmp_path)
    vms = MicroVms(tmp_path / "state", tmp_path / "run", NoGuest(), drivers=drivers,
                   guest_dir=guests)
    made: list[Any] = []
    async with trio.open_nursery() as n:
        before = trio.current_time()
        await n.start(vms.run)
        assert trio.current_time() - before == pytest.approx(_service.QUICK_S)
        assert vms.choice is None
        await trio.sleep(4)
        assert vms.probing() == ("feosd is still probing which VMM runs pods (--vmm auto: KVM, "
                                 "Firecracker; 5 s so far)")
        assert vmm_info(None, [], vms.probing())["reason"] == vms.probing()
        with pytest.raises(FeosError) as exc:
            vms.driver_for(POD)
        assert exc.value.code is Code.UNAVAILABLE
        assert exc.value.message == f"{vms.probing()}: try again in a few seconds"

        done = trio.Event()

        async def create() -> None:
            made.append(await vms.create(POD, VmSpec()))
            done.set()

        n.start_soon(create)
        await trio.sleep(30)
        assert made == [] and drivers["firecracker"].calls == []
        release.set()
        await done.wait()
        assert vms.choice == FC and vms.probing() == ""
        assert [(i.driver, i.accel) for i in made] == [("firecracker", "kvm")]
        assert vms.driver_for(POD) == "firecracker"
        n.cancel_scope.cancel()


async def test_a_quick_probe_is_decided_before_the_service_starts(
        tmp_path: Path, guests: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: Any) -> None:
    """An answer within QUICK_S (the probes' caches; no /dev/kvm) is there before it serves."""

    async def choose(requested: str, state_dir: Path) -> VmmChoice:
        await trio.sleep(0.2)
        return QEMU_TCG

    monkeypatch.setattr(_service, "choose_vmm", choose)
    vms = MicroVms(tmp_path / "state", tmp_path / "run", NoGuest(), drivers=_drivers(tmp_path),
                   guest_dir=guests)
    async with trio.open_nursery() as n:
        before = trio.current_time()
        await n.start(vms.run)
        assert trio.current_time() - before == pytest.approx(0.2)
        assert vms.choice == QEMU_TCG and vms.probing() == ""
        n.cancel_scope.cancel()


async def test_a_probe_that_fails_after_the_start_ends_the_service(
        tmp_path: Path, guests: Path, monkeypatch: pytest.MonkeyPatch,
        autojump_clock: Any) -> None:
    """A probe's error after the service started is the service's end (feosd stops with it),
    not a node that serves without a VMM for ever."""

    async def choose(requested: str, state_dir: Path) -> VmmChoice:
        await trio.sleep(10)
        return VmmChoice("cloud-hypervisor", "kvm", "fake", "auto")

    monkeypatch.setattr(_service, "choose_vmm", choose)
    vms = MicroVms(tmp_path / "state", tmp_path / "run", NoGuest(), drivers=_drivers(tmp_path),
                   guest_dir=guests)
    errors: list[FeosError] = []
    try:
        async with trio.open_nursery() as n:
            await n.start(vms.run)
            await trio.sleep_forever()
    except* FeosError as group:
        errors += [e for e in _leaves(group) if isinstance(e, FeosError)]
    assert [(e.code, e.message) for e in errors] == [
        (Code.FAILED_PRECONDITION, "no driver for cloud-hypervisor")]


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out
