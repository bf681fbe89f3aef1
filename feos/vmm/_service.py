"""The microVM service (MicroVms): what the pod service calls to run its pods' microVMs.

Theory of operation. The service owns one nursery (`run`), the records (vms.db, written on a
worker thread after the driver call that made a change returned), and per microVM a lock, a guest
link (from creation to deletion) and, while a VMM runs, a watcher that waits for its end. Every
change runs under the microVM's lock and is checked against one table, `next_state`. Events
(Stopped, Crashed, Suspended, GuestAttached) go to every subscriber's memory channel once the
change is recorded.

The node's VMM (`VmmChoice`: QEMU or Firecracker, KVM or TCG) is decided once, at the start
(_choice.py), and every microVM created from then on is made with it. The probes behind it can
take seconds (a guest kernel booted under KVM, or under nested KVM on TCG: 5 to 20 s) and feosd
does not wait for them to serve: `run` waits QUICK_S (an answer from the probes' caches, or a
node without /dev/kvm, is there by then), then the probe goes on in the service's nursery.
Until it ends, what needs the choice waits for it (`decided`: a create, a start that moves a
microVM, a restore; the pod's step says `vmm-probe` meanwhile), what cannot wait (`driver_for`
of a microVM without a VMM of its own, `vmm_version`) is refused UNAVAILABLE naming the probe,
and host info says it is probing (`probing`). A microVM keeps the VMM
its record names while it has a process or a snapshot (running, busy, suspended), across
restarts of feosd too; one that has neither (created, stopped, crashed) is moved to the node's
VMM at its next start (`_rehome`: the old driver's directory removed, the new one prepared from
the same spec). `driver_for` says which VMM a microVM's next boot or resume runs.

A suspend past its snapshot's timeout leaves the microVM BUSY: the call fails with the busy
marker, a task waits for the VMM to finish, runs the VM again and discards the snapshot; until
then suspends and shutdowns are refused as busy. The VMM processes outlive feosd (a session of
their own); a service that starts again reads vms.db and takes each microVM over through its
driver's `adopt`, restarting none. With `hold_links` (feosd) the guest links wait until
`open_links()`: feosd takes the microVMs over, serves its API, and only then do the links dial
their guests, all at once, so that a restart with pods serves as soon as one without; a guest
call meanwhile waits for its link (`guest`, within its seconds) as it does after a boot.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError, busy

from ._budget import suspend_budget_mib
from ._choice import VmmChoice, choose_vmm, vmm_name
from ._driver import Driver, Exit, VmHandle, VmSpec, VmState
from ._guestlink import RESUME_PING_S, GuestLink
from ._qemu import QemuDriver
from ._records import Records, VmRecord, check_id

log = logging.getLogger("feos.vmm")

UID_BASE = 2_000_000  # the microVMs' own users: 2000000, 2000001, ... (one each, kept)
ATTACH_S = 60.0
BOOT_S = 30.0
SHUTDOWN_S = 30.0
GUEST_CALL_S = 5.0
PURGE_S = 10.0
SETTLE_S = 3.0
QUICK_S = 1.0  # how long the start waits for the VMM probe before it serves without it

# -- the state table -------------------------------------------------------------------------

_S = VmState
_TABLE: dict[tuple[VmState, str], VmState] = {
    (_S.CREATED, "start"): _S.RUNNING,
    (_S.STOPPED, "start"): _S.RUNNING,
    (_S.CRASHED, "start"): _S.RUNNING,
    (_S.RUNNING, "shutdown"): _S.STOPPED,
    (_S.RUNNING, "suspend"): _S.SUSPENDED,
    (_S.RUNNING, "late"): _S.BUSY,
    (_S.RUNNING, "stopped"): _S.STOPPED,
    (_S.RUNNING, "crashed"): _S.CRASHED,
    (_S.SUSPENDED, "resume"): _S.RUNNING,
    (_S.SUSPENDED, "crashed"): _S.CRASHED,
    (_S.BUSY, "late-done"): _S.RUNNING,
    (_S.BUSY, "crashed"): _S.CRASHED,
}
_IDEMPOTENT = {
    ("start", _S.RUNNING), ("shutdown", _S.STOPPED), ("shutdown", _S.CREATED),
    ("shutdown", _S.CRASHED), ("suspend", _S.SUSPENDED), ("resume", _S.RUNNING),
}  # fmt: skip


def next_state(state: VmState, op: str, vmm: str = "the VMM") -> VmState:
    """The state `op` leads to from `state`; busy() or FAILED_PRECONDITION where it may not.
    `vmm` names the microVM's VMM in the busy message ("QEMU", "Firecracker")."""
    found = _TABLE.get((state, op))
    if found is not None:
        return found
    if state is _S.BUSY and op in ("shutdown", "suspend", "start", "resume"):
        raise busy(f"{vmm} still writes a late snapshot; ask again later")
    raise FeosError(Code.FAILED_PRECONDITION, f"a microVM that is {state.value} cannot {op}")


def is_noop(state: VmState, op: str) -> bool:
    """A call that finds what it would make (a start of a running VM) answers without acting."""
    return (op, state) in _IDEMPOTENT


# -- values the pod service sees -----------------------------------------------------------


@attrs.frozen
class VmInfo:
    id: str
    state: VmState
    reason: str
    driver: str
    accel: str
    guest_version: str
    vcpus: int
    memory_mib: int
    attached: bool


@attrs.frozen
class Stopped:
    id: str
    reason: str


@attrs.frozen
class Crashed:
    id: str
    reason: str


@attrs.frozen
class Suspended:
    id: str


@attrs.frozen
class GuestAttached:
    id: str
    boot_id: str


VmEvent = Stopped | Crashed | Suspended | GuestAttached


def newest_guest(guest_root: Path) -> tuple[str, Path]:
    """The newest installed guest: the greatest (manifest's build time, version)."""
    best: tuple[str, str, Path] | None = None
    for d in guest_root.iterdir() if guest_root.is_dir() else []:
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        key = (str(manifest.get("built", "")), str(manifest.get("version", d.name)), d)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise FeosError(Code.FAILED_PRECONDITION, f"no guest is installed in {guest_root}")
    return best[2].name, best[2]


def installed_guests(root: Path) -> list[str]:
    """The installed guest versions, newest first (by the manifest's build time)."""
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        found.append((str(manifest.get("built", "")), d.name))
    return [name for _, name in sorted(found, reverse=True)]


def guest_root() -> Path:
    return Path(os.environ.get("FEOS_GUEST_DIR", "/usr/lib/feos/guest"))


@attrs.define
class _Vm:
    record: VmRecord
    handle: VmHandle
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    link: GuestLink | None = None
    scopes: list[trio.CancelScope] = attrs.field(factory=list)  # the link's and watchers'
    link_scope: trio.CancelScope | None = None
    listener: socket.socket | None = None  # the guest's uplink where the node listens (vsock)
    taken_over: bool = False  # found running at the start: its link re-attaches after it

    generation: int = 0
    suspending: bool = False
    deleted: bool = False
    changed: trio.Event = attrs.field(factory=trio.Event)  # set and renewed at every change

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class MicroVms:
    """The microVM service. `await nursery.start(service.run)` opens it and takes VMs over."""

    def __init__(
        self,
        state_dir: Path,
        run_dir: Path,
        bridge: Any,
        *,
        driver: Driver | None = None,
        drivers: Mapping[str, Driver] | None = None,
        choice: VmmChoice | None = None,
        vmm: str = "auto",
        accel: str | None = None,
        guest_dir: Path | None = None,
        attach_timeout: float = ATTACH_S,
        snapshot_timeout: float | None = None,
        cgroups: Any | None = None,
        network: Callable[[str], Awaitable[Any | None]] | None = None,
        clock_interval: float = 60.0,
        hold_links: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.run_dir = Path(run_dir)
        self._bridge = bridge
        # The drivers by name: the node's choice boots new microVMs, any other serves the
        # microVMs that still run (or are suspended) under it. `driver` (tests): that one alone.
        self._drivers: dict[str, Driver] = dict(drivers or {})
        if driver is not None:
            self._drivers[driver.name] = driver
        if not self._drivers:
            self._drivers = default_drivers(self.state_dir, cgroups)
        if choice is None and (driver is not None or accel is not None):
            name = driver.name if driver is not None else "qemu"
            choice = VmmChoice(name, accel or ("kvm" if name == "firecracker" else "tcg"),
                               "given by the caller", "given")  # fmt: skip
        self._choice = choice
        self._decided = trio.Event()
        if choice is not None:
            self._decided.set()
        self._probe_started: float | None = None  # trio's clock, from the probe's start
        self._vmm_request = vmm
        self._quick_s = QUICK_S
        self._guest_root = guest_dir
        self._attach_timeout = attach_timeout
        self._snapshot_timeout = snapshot_timeout
        self._cgroups = cgroups
        self._network = network
        self._clock_interval = clock_interval
        self._links_open = trio.Event()  # until set, the links made wait before they dial
        if not hold_links:
            self._links_open.set()
        self._vms: dict[str, _Vm] = {}
        self._subscribers: list[trio.MemorySendChannel[VmEvent]] = []
        self._write_lock = trio.Lock()
        self._records: Records | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def accel(self) -> str:
        return self._choice.accel if self._choice is not None else ""

    @property
    def choice(self) -> VmmChoice | None:
        """The node's VMM (None before `run` decided it)."""
        return self._choice

    def probing(self) -> str:
        """While the VMM probe runs: what it is doing and for how long (host info, refusals);
        "" once the node's VMM is decided."""
        if self._choice is not None:
            return ""
        if self._probe_started is None:
            return "feosd has not started probing which VMM runs pods yet"
        took = trio.current_time() - self._probe_started
        return (f"feosd is still probing which VMM runs pods (--vmm {self._vmm_request}: KVM"
                f"{'' if self._vmm_request == 'qemu' else ', Firecracker'}; {took:.0f} s so far)")

    async def decided(self) -> VmmChoice:
        """The node's VMM, once the probe has decided it (at once if it has)."""
        await self._decided.wait()
        assert self._choice is not None
        return self._choice

    def _choose(self) -> VmmChoice:
        if self._choice is None:
            raise FeosError(Code.UNAVAILABLE, f"{self.probing()}: try again in a few seconds")
        return self._choice

    async def _decide(self) -> None:
        """The probes and the choice (run's first task); the waiters woken."""
        self._probe_started = trio.current_time()
        choice = self._driven(await choose_vmm(self._vmm_request, self.state_dir))
        took = trio.current_time() - self._probe_started
        if took > self._quick_s:
            log.info("the VMM probe took %.1f s; the API was served meanwhile", took)
        self._choice = choice
        self._decided.set()

    def _driven(self, choice: VmmChoice) -> VmmChoice:
        """The choice, if this service has its driver."""
        if choice.driver not in self._drivers:
            raise FeosError(Code.FAILED_PRECONDITION, f"no driver for {choice.driver}")
        return choice

    def _driver(self, vm: _Vm) -> Driver:
        return self._drivers[vm.record.driver]

    def driver_for(self, vm_id: str) -> str:
        """The VMM a microVM's next boot or resume runs: its own while it has a process or a
        snapshot (running, busy, suspended), else (none yet, created, stopped, crashed) the
        node's. What the pod service keeps as the pod's driver and tells the network."""
        vm = self._vms.get(vm_id)
        if vm is not None and vm.record.state in _KEEPS_ITS_VMM:
            return vm.record.driver
        return self._choose().driver

    # -- running ------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._records = await trio.to_thread.run_sync(Records, self.state_dir / "vms.db")
        if self._choice is not None:
            self._driven(self._choice)
        if self._cgroups is not None:
            from . import _cgroup

            await trio.to_thread.run_sync(_cgroup.prepare, self._cgroups)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._choice is None:  # the probe: served without it if it takes long
                    nursery.start_soon(self._decide)
                    with trio.move_on_after(self._quick_s):
                        await self._decided.wait()
                # every microVM's VMM asked at once, not one after another: feosd serves
                # only after them, so a restart with pods is not longer by a round trip a pod
                async with trio.open_nursery() as adopting:
                    for record in await trio.to_thread.run_sync(self._records.all):
                        adopting.start_soon(self._take_over, record)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            log.debug("the microVMs' tasks have ended")
            for driver in self._drivers.values():
                close = getattr(driver, "close", None)
                if close is not None:
                    close()
            for send in self._subscribers:
                send.close()
            records = self._records
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(records.close)
            log.debug("the microVMs' records are closed")

    def open_links(self) -> None:
        """The guest links held since the start (`hold_links`) dial their guests now."""
        self._links_open.set()

    def subscribe(self, buffer: int = 256) -> trio.MemoryReceiveChannel[VmEvent]:
        send, recv = trio.open_memory_channel[VmEvent](buffer)
        self._subscribers.append(send)
        return recv

    def _emit(self, event: VmEvent) -> None:
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except trio.WouldBlock:
                log.warning("a subscriber of microVM events is full; dropped %r", event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)

    # -- the calls --------------------------------------------------------------------

    async def create(self, vm_id: str, spec: VmSpec) -> VmInfo:
        check_id(vm_id)
        _check_spec(spec)
        if vm_id in self._vms:
            vm = self._vms[vm_id]
            if vm.record.spec != spec:
                raise FeosError(Code.ALREADY_EXISTS, f"microVM {vm_id} exists with another spec")
            return self._info(vm)
        version, gdir = newest_guest(self._guest_root or guest_root())
        choice = await self.decided()
        record = VmRecord(vm_id, choice.driver, VmState.CREATED, "", version, choice.accel,
                          spec, self._free_uid())  # fmt: skip
        return await self._admit(record, gdir)

    async def _admit(self, record: VmRecord, gdir: Path,
                     then: Callable[[], Awaitable[None]] | None = None) -> VmInfo:
        """A new microVM registered and prepared by its driver (then `then`, e.g. a snapshot
        moved in), then recorded in its record's state. On any failure it is forgotten and
        what its driver prepared is removed."""
        vm = self._new_vm(record, gdir)
        async with vm.lock:
            self._vms[record.id] = vm
            try:
                await self._driver(vm).prepare(vm.handle)
                if then is not None:
                    await then()
            except BaseException:
                del self._vms[record.id]
                with trio.CancelScope(shield=True), trio.move_on_after(30):
                    await self._driver(vm).delete(vm.handle)
                raise
            await self._record(vm, record.state, record.reason)
            self._start_link(vm)
        return self._info(vm)

    async def start(self, vm_id: str, *, wait_attach: bool = True) -> VmInfo:
        vm = self._get(vm_id)
        async with vm.lock:
            if is_noop(vm.record.state, "start"):
                return self._info(vm)
            next_state(vm.record.state, "start", vmm_name(vm.record.driver))
            await self._rehome(vm)
            assert vm.link is not None
            attaches = vm.link.attaches
            await self._boot(vm)
            if wait_attach:
                await self._await_attach(vm, attaches)
        return self._info(vm)

    async def _rehome(self, vm: _Vm) -> None:
        """A microVM without process or snapshot moves to the node's VMM before it boots: the
        old driver's directory goes, the new driver prepares the same spec (disks, TAP, uid)."""
        choice = await self.decided()
        if (vm.record.driver, vm.record.accel) == (choice.driver, choice.accel):
            return
        was = f"{vmm_name(vm.record.driver)} under {vm.record.accel.upper()}"
        self._stop_link(vm)
        await self._driver(vm).delete(vm.handle)
        record = attrs.evolve(vm.record, driver=choice.driver, accel=choice.accel)
        vm.record, vm.handle = record, self._handle(record, vm.handle.guest_dir)
        await self._driver(vm).prepare(vm.handle)
        await self._record(vm, vm.record.state, vm.record.reason)
        self._start_link(vm)
        log.info("microVM %s boots under %s now (it was made for %s)", record.id,
                 choice.describe(), was)  # fmt: skip

    async def _boot(self, vm: _Vm) -> None:
        await self._driver(vm).start(vm.handle, within=BOOT_S)
        await self._join_cgroup(vm)
        await self._record(vm, VmState.RUNNING, "")
        self._watch(vm)
        if vm.link is not None:
            vm.link.kick()

    async def _await_attach(self, vm: _Vm, attaches: int) -> None:
        assert vm.link is not None
        try:
            with trio.fail_after(self._attach_timeout):
                await vm.link.wait_attach(attaches)
        except trio.TooSlowError:
            reason = f"the guest did not attach within {self._attach_timeout:g}s"
            await self._kill(vm)
            await self._record(vm, VmState.CRASHED, reason)
            self._emit(Crashed(vm.record.id, reason))
            raise FeosError(Code.UNAVAILABLE, f"microVM {vm.record.id}: {reason}") from None

    async def _kill(self, vm: _Vm) -> None:
        kill = getattr(self._driver(vm), "_kill", None)
        if kill is not None:
            await kill(vm.record.id)

    async def shutdown(self, vm_id: str, *, grace: float = SHUTDOWN_S) -> VmInfo:
        vm = self._get(vm_id)
        self._refuse_late(vm)
        async with vm.lock:
            if is_noop(vm.record.state, "shutdown"):
                return self._info(vm)
            next_state(vm.record.state, "shutdown", vmm_name(vm.record.driver))
            await self._guest_shutdown(vm)
            exit_ = await self._driver(vm).shutdown(vm.handle, grace=grace)
            await self._ended(vm, exit_)
        return self._info(vm)

    async def _guest_shutdown(self, vm: _Vm) -> None:
        """The agent's Shutdown first (it stops the containers, syncs): ACPI is the fallback.

        A guest link still attaching (just after a start or a takeover) gets 5 s."""
        if vm.link is None:
            return
        try:
            with trio.fail_after(GUEST_CALL_S):
                client = await vm.link.session(GUEST_CALL_S)
                await vm.link.call(client.shutdown)
        except (FeosError, trio.TooSlowError) as exc:
            log.info("microVM %s: the guest's Shutdown failed (%s); ACPI", vm.record.id, exc)

    async def suspend(self, vm_id: str, *, purge_guest: bool = True) -> VmInfo:
        vm = self._get(vm_id)
        self._refuse_late(vm)
        async with vm.lock:
            if is_noop(vm.record.state, "suspend"):
                return self._info(vm)
            next_state(vm.record.state, "suspend", vmm_name(vm.record.driver))
            vm.suspending = True
            try:
                await self._suspend(vm, purge_guest)
            finally:
                vm.suspending = False
                vm.poke()
        return self._info(vm)

    async def _suspend(self, vm: _Vm, purge_guest: bool) -> None:
        budget = suspend_budget_mib(vm.record.spec.memory_mib)
        if purge_guest:
            await self._purge(vm)
        timeout = self._snapshot_timeout or float(budget.snapshot_s)
        if vm.link is not None:
            await vm.link.park()  # the session can go on after the resume
        try:
            await self._driver(vm).suspend(vm.handle, snapshot_timeout=timeout)
        except BaseException as exc:
            if not (isinstance(exc, FeosError) and exc.busy) and vm.link is not None:
                vm.link.unpark()  # no suspend: the session goes on over the same VMM
            if isinstance(exc, FeosError) and exc.busy:
                await self._record(vm, VmState.BUSY, exc.message)
                assert self._nursery is not None
                self._nursery.start_soon(self._late_done, vm, vm.generation)
            raise
        vm.generation += 1  # the watcher of the ended VMM records nothing
        await self._record(vm, VmState.SUSPENDED, "")
        self._emit(Suspended(vm.record.id))

    async def _purge(self, vm: _Vm) -> None:
        """The guest drops its caches and compacts; the balloon's reporting settles."""
        link = vm.link
        if link is not None and link.client is not None:
            try:
                with trio.fail_after(PURGE_S):
                    await link.call(link.client.prepare_suspend)
            except (FeosError, trio.TooSlowError) as exc:
                log.info("microVM %s: PrepareSuspend failed: %s", vm.record.id, exc)
        settle = getattr(self._driver(vm), "settle", None)
        if settle is not None:
            await settle(vm.handle, within=SETTLE_S)

    async def _late_done(self, vm: _Vm, generation: int) -> None:
        try:
            await self._driver(vm).late_snapshot_done(vm.handle)
        except FeosError as exc:
            log.warning("microVM %s: after its late snapshot: %s", vm.record.id, exc)
            return
        if vm.link is not None:
            vm.link.unpark()  # the VM runs on in the same VMM: so does the guest's session
        async with vm.lock:
            if not vm.deleted and vm.generation == generation:
                await self._record(vm, VmState.RUNNING, "")
                log.info("microVM %s runs again after its late snapshot", vm.record.id)

    async def resume(self, vm_id: str) -> VmInfo:
        vm = self._get(vm_id)
        async with vm.lock:
            if is_noop(vm.record.state, "resume"):
                return self._info(vm)
            next_state(vm.record.state, "resume", vmm_name(vm.record.driver))
            assert vm.link is not None
            pinged = vm.link.resuming()
            sessions = vm.link.sessions
            ran: list[float] = []

            def running() -> None:
                # The guest runs: the link pings it (through the session kept across the
                # suspend when it rejoined) while the driver and the service finish beside it.
                ran.append(time.monotonic())
                assert vm.link is not None
                vm.link.kick()

            try:
                await self._driver(vm).resume(vm.handle, within=BOOT_S, rejoin=vm.link.rejoin,
                                          running=running)  # fmt: skip
            except BaseException:
                if not ran:
                    vm.link.drop()  # a session that rejoined a VMM that never ran is not kept
                raise
            if not ran:  # a driver that did not say when it ran
                running()
            await self._join_cgroup(vm)
            await self._record(vm, VmState.RUNNING, "")
            self._watch(vm)
            with trio.move_on_after(RESUME_PING_S) as waited:
                await pinged.wait()
            if waited.cancelled_caught:
                log.warning("microVM %s: the resumed guest did not answer its ping within "
                            "%gs", vm_id, RESUME_PING_S)  # fmt: skip
            else:
                log.debug("microVM %s: the resumed guest answered its ping %.1f ms after it "
                          "ran (session %s)", vm_id, 1000 * (time.monotonic() - ran[0]),
                          "kept" if vm.link.sessions == sessions else "new")  # fmt: skip
        return self._info(vm)

    async def seed(self, vm_id: str, memory: Path) -> VmInfo:
        """A created microVM given a template's snapshot (its memory, read, never changed):
        SUSPENDED, so that `resume` restores it as a suspended one. Its spec must be the
        template's shape, which the pod service's templates see to."""
        vm = self._get(vm_id)
        async with vm.lock:
            if vm.record.state is not VmState.CREATED:
                raise FeosError(Code.FAILED_PRECONDITION,
                                f"microVM {vm_id} is {vm.record.state.value}, not created")
            seed = getattr(self._driver(vm), "seed", None)
            if seed is None:
                raise FeosError(Code.FAILED_PRECONDITION, f"{vmm_name(vm.record.driver)} "
                                "restores no template here (QEMU does)")
            await seed(vm.handle, memory)
            await self._record(vm, VmState.SUSPENDED, "seeded from a template")
        return self._info(vm)

    async def delete(self, vm_id: str) -> None:
        vm = self._vms.get(vm_id)
        if vm is None:
            check_id(vm_id)
            return
        async with vm.lock:
            vm.deleted = True
            for scope in vm.scopes:
                scope.cancel()
            await self._driver(vm).delete(vm.handle)
            if self._cgroups is not None and not _own_cgroups(self._driver(vm)):
                await trio.to_thread.run_sync(_cgroup_remove, self._cgroups, vm_id)
            async with self._write_lock:
                assert self._records is not None
                await trio.to_thread.run_sync(self._records.remove, vm_id)
            self._vms.pop(vm_id, None)

    # -- hibernation's parts (feos.pods._hibernate) -------------------------------------

    def snapshot_file(self, vm_id: str) -> Path:
        """The memory of a suspended microVM, the file its VMM reads at a resume.
        FAILED_PRECONDITION: its VMM keeps none that another node could load (Firecracker's
        memory is served lazily by diskd: not built here)."""
        vm = self._get(vm_id)
        where = getattr(self._driver(vm), "snapshot_file", None)
        if where is None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"{vmm_name(vm.record.driver)} snapshots cannot be hibernated here")
        path: Path = where(vm.handle)
        return path

    def vmm_version(self, driver: str | None = None) -> str:
        """The VMM's version, which a snapshot's restore must run (\"qemu 7.2.19\")."""
        name = driver or self._choose().driver
        version = getattr(self._drivers.get(name), "version", None)
        if version is None:
            raise FeosError(Code.FAILED_PRECONDITION, f"{vmm_name(name)} is not installed here")
        found: str = version()
        return found

    async def restore(self, vm_id: str, spec: VmSpec, *, guest_version: str, driver: str,
                      memory: Path) -> VmInfo:
        """A microVM made SUSPENDED on a snapshot's memory (moved in), as it was on the node
        that made it: the same guest and VMM, which must be installed (FAILED_PRECONDITION)."""
        check_id(vm_id)
        _check_spec(spec)
        if vm_id in self._vms:
            raise FeosError(Code.ALREADY_EXISTS, f"microVM {vm_id} exists")
        gdir = (self._guest_root or guest_root()) / guest_version
        if not (gdir / "manifest.json").exists():
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"the snapshot's guest {guest_version} is not installed here")
        if driver not in self._drivers:
            raise FeosError(Code.FAILED_PRECONDITION, f"{vmm_name(driver)} is not installed here")
        choice = await self.decided()
        accel = choice.accel if choice.driver == driver else "tcg"
        record = VmRecord(vm_id, driver, VmState.SUSPENDED, "restored", guest_version, accel,
                          spec, self._free_uid())  # fmt: skip

        async def move_in() -> None:
            await trio.to_thread.run_sync(_move_in, memory, self.snapshot_file(vm_id))

        return await self._admit(record, gdir, move_in)

    def get(self, vm_id: str) -> VmInfo:
        return self._info(self._get(vm_id))

    def snapshot(self, vm_id: str) -> Path:
        """A suspended QEMU microVM's memory (what a template keeps of its guest)."""
        vm = self._get(vm_id)
        return self._driver(vm).directory(vm_id) / "snapshot" / "memory"

    def list(self) -> list[VmInfo]:
        return [self._info(vm) for vm in self._vms.values()]

    async def guest(self, vm_id: str, *, within: float = GUEST_CALL_S) -> GuestHandle:
        """The attached guest of a pod, for its calls; UNAVAILABLE (busy when known) otherwise."""
        vm = self._get(vm_id)
        message = f"the guest of pod {vm_id} did not answer within {within:g}s"
        with trio.move_on_after(within):
            while _busy_reason(vm) is not None:
                await vm.changed.wait()
            assert vm.link is not None
            client = await vm.link.session(within)
            return GuestHandle(self._bridge, client)
        reason = _busy_reason(vm)
        if reason is not None:
            raise FeosError(Code.UNAVAILABLE, f"{message}; the VM is busy: {reason}", busy=True)
        if vm.taken_over and vm.link is not None and vm.link.attaches == 0:
            message += " (its link has not re-attached since feosd started)"
        raise FeosError(Code.UNAVAILABLE, message)

    # -- internals --------------------------------------------------------------------

    def _get(self, vm_id: str) -> _Vm:
        vm = self._vms.get(check_id(vm_id))
        if vm is None:
            raise FeosError(Code.NOT_FOUND, f"microVM {vm_id} does not exist")
        return vm

    def _refuse_late(self, vm: _Vm) -> None:
        if vm.record.state is VmState.BUSY:
            raise busy(_late_message(vm))

    def _info(self, vm: _Vm) -> VmInfo:
        r = vm.record
        attached = vm.link is not None and vm.link.client is not None
        return VmInfo(r.id, r.state, r.reason, r.driver, r.accel, r.guest_version,
                      r.spec.vcpus, r.spec.memory_mib, attached)  # fmt: skip

    def _free_uid(self) -> int:
        used = {vm.record.uid for vm in self._vms.values()}
        uid = UID_BASE
        while uid in used:
            uid += 1
        return uid

    def _new_vm(self, record: VmRecord, gdir: Path) -> _Vm:
        return _Vm(record, self._handle(record, gdir))

    def _handle(self, record: VmRecord, gdir: Path) -> VmHandle:
        directory = self._drivers[record.driver].directory(record.id)
        return VmHandle(record.id, record.spec, directory, record.guest_version, gdir,
                        record.accel, record.uid)  # fmt: skip

    async def _record(self, vm: _Vm, state: VmState, reason: str) -> None:
        """Keep the change in vms.db (worker thread, one write at a time), then in memory."""
        record = attrs.evolve(vm.record, state=state, reason=reason)
        async with self._write_lock:
            assert self._records is not None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._records.put, record)
        vm.record = record
        vm.poke()

    def _start_link(self, vm: _Vm) -> None:
        vm_id = vm.record.id

        async def network() -> Any | None:
            return await self._network(vm_id) if self._network is not None else None

        def attached(client: Any) -> None:
            self._emit(GuestAttached(vm_id, str(getattr(client, "boot_id", ""))))

        driver = self._driver(vm)
        connect = None
        listen = getattr(driver, "listen", None)
        if listen is not None:  # the guest dials the node (Firecracker's vsock): accept
            vm.listener = listen(vm.handle)
            connect = functools.partial(accept_guest, vm.listener)
        vm.link = GuestLink(vm_id, driver.guest_link(vm.handle), self._bridge,
                            network=network, on_attach=attached, connect=connect,
                            clock_interval=self._clock_interval)  # fmt: skip
        assert self._nursery is not None
        self._nursery.start_soon(self._run_link, vm, vm.link, vm.listener)

    async def _run_link(self, vm: _Vm, link: GuestLink, listener: socket.socket | None) -> None:
        """The link's task; its listener is closed when the link has ended (the accept on the
        Cap'n Proto thread cancelled first)."""
        try:
            with trio.CancelScope() as scope:
                vm.link_scope = scope
                await self._links_open.wait()
                await self._in_scope(vm, link.run)
        finally:
            if listener is not None:
                listener.close()

    def _stop_link(self, vm: _Vm) -> None:
        if vm.link_scope is not None:
            vm.link_scope.cancel()
        vm.link = vm.link_scope = vm.listener = None

    async def _in_scope(self, vm: _Vm, fn: Callable[[], Awaitable[None]]) -> None:
        with trio.CancelScope() as scope:
            vm.scopes.append(scope)
            try:
                await fn()
            finally:
                vm.scopes.remove(scope)

    def _watch(self, vm: _Vm) -> None:
        vm.generation += 1
        generation = vm.generation

        async def watch() -> None:
            exit_ = await self._driver(vm).wait(vm.handle)
            async with vm.lock:
                if vm.generation == generation and vm.record.state is VmState.RUNNING:
                    await self._ended(vm, exit_)

        assert self._nursery is not None
        self._nursery.start_soon(self._in_scope, vm, watch)

    async def _ended(self, vm: _Vm, exit_: Exit) -> None:
        vm.generation += 1
        await self._record(vm, exit_.state, exit_.reason)
        if exit_.state is VmState.STOPPED:
            self._emit(Stopped(vm.record.id, exit_.reason))
        else:
            self._emit(Crashed(vm.record.id, exit_.reason))
        log.info("microVM %s %s: %s", vm.record.id, exit_.state.value, exit_.reason)

    async def _join_cgroup(self, vm: _Vm) -> None:
        driver = self._driver(vm)
        pid = getattr(driver, "pid", lambda _h: None)(vm.handle)
        if self._cgroups is None or pid is None or _own_cgroups(driver):
            return
        await trio.to_thread.run_sync(_cgroup_join, self._cgroups, vm.record.id,
                                      vm.record.spec.vcpus, pid)  # fmt: skip

    async def _take_over(self, record: VmRecord) -> None:
        """A record found at the start: the microVM is adopted as its driver finds it."""
        if record.driver not in self._drivers:
            log.warning("microVM %s is recorded under %r, which this feosd has no driver of: "
                        "left alone", record.id, record.driver)  # fmt: skip
            return
        try:
            gdir = (self._guest_root or guest_root()) / record.guest_version
            vm = self._new_vm(record, gdir)
            self._vms[record.id] = vm
            self._start_link(vm)
            if record.state not in _KEEPS_ITS_VMM:
                return
            found = await self._driver(vm).adopt(vm.handle)
        except FeosError as exc:
            log.warning("microVM %s could not be taken over: %s", record.id, exc)
            return
        log.info("microVM %s taken over under %s: %s %s", record.id, vmm_name(record.driver),
                 found.state.value, found.reason)  # fmt: skip
        if found.state in (VmState.RUNNING, VmState.BUSY):
            vm.taken_over = True
            self._watch(vm)
            assert vm.link is not None
            vm.link.kick()
        if found.state is VmState.BUSY:
            assert self._nursery is not None
            self._nursery.start_soon(self._late_done, vm, vm.generation)
        if (found.state, found.reason) != (record.state, record.reason):
            await self._record(vm, found.state, found.reason)


class GuestHandle:
    """An attached guest for the pod service: `await handle.call(client_method, *args)` or
    `await handle.ping()`; every method of feos.guest.GuestClient, run on its thread."""

    def __init__(self, bridge: Any, client: Any) -> None:
        self._bridge = bridge
        self.client = client

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await self._bridge.call(fn, *args)

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.client, name)

        async def call(*args: Any) -> Any:
            return await self._bridge.call(method, *args)

        return call


_KEEPS_ITS_VMM = (VmState.RUNNING, VmState.BUSY, VmState.SUSPENDED)


def _late_message(vm: _Vm) -> str:
    return f"{vmm_name(vm.record.driver)} still writes the snapshot of microVM {vm.record.id}"


def _busy_reason(vm: _Vm) -> str | None:
    if vm.suspending:
        return f"microVM {vm.record.id} is being suspended"
    if vm.record.state is VmState.BUSY:
        return _late_message(vm)
    return None


def _own_cgroups(driver: Driver) -> bool:
    """Whether the driver puts its VMMs into their cgroups itself (Firecracker's jailer)."""
    return bool(getattr(driver, "own_cgroups", False))


def default_drivers(state_dir: Path, cgroups: Any | None) -> dict[str, Driver]:
    """Both drivers: the node's choice boots, the other serves what still runs under it."""
    from ._firecracker import FirecrackerDriver

    return {"qemu": QemuDriver(state_dir),
            "firecracker": FirecrackerDriver(state_dir, cgroups=cgroups)}


async def accept_guest(listener: socket.socket, path: str, deadline: float = 5.0) -> Any:
    """The guest link's connect where the guest dials the node (on the Cap'n Proto thread).
    A connection that ends or fails before its session started is UNAVAILABLE, as a dial's."""
    from feos.guestlink import GuestClient

    try:
        return await GuestClient.accept(listener, deadline=deadline)
    except EOFError:
        raise FeosError(Code.UNAVAILABLE, "the guest link closed before the hello") from None
    except OSError as exc:
        raise FeosError(Code.UNAVAILABLE, f"the guest link {path}: {exc.strerror or exc}") from None


def _move_in(memory: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    memory.replace(target)


def _check_spec(spec: VmSpec) -> None:
    if not 1 <= spec.vcpus <= 32:
        raise FeosError(Code.INVALID_ARGUMENT, "spec.vcpus: must be 1 to 32")
    if not 64 <= spec.memory_mib <= 1 << 20:
        raise FeosError(Code.INVALID_ARGUMENT, "spec.memory_mib: must be 64 MiB to 1 TiB")
    try:
        json.loads(spec.metadata)
    except ValueError:
        raise FeosError(Code.INVALID_ARGUMENT, "spec.metadata: must be JSON") from None


def _cgroup_join(layout: Any, vm_id: str, vcpus: int, pid: int) -> None:
    from . import _cgroup

    _cgroup.create(layout, vm_id, vcpus)
    _cgroup.add_pid(layout, vm_id, pid)


def _cgroup_remove(layout: Any, vm_id: str) -> None:
    from . import _cgroup

    _cgroup.remove(layout, vm_id)
