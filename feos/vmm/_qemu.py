"""The QEMU driver: `-M microvm` under TCG (or KVM where it really runs guests), driven by QMP.

Theory of operation. A microVM's directory, <state>/vms/qemu/<id>/, holds everything of it:

    config       the argv as JSON, written at creation (a resume adds -S -incoming fd:N)
    qmp.sock     QMP (one client at a time: the driver keeps one connection per live VM and
                 shares it between its commands and its watch for SHUTDOWN)
    guest.sock   the guest link, a virtio-serial port (QEMU is the socket's server)
    serial.log   the guest's console since the last boot; console.in, a FIFO, is its input
    vmm.log      QEMU's own stderr
    vmlinux, initramfs, root.erofs   linked from the guest version; data, volume0.. linked too
    snapshot/    memory (QEMU's migration stream) of a suspended VM
    qemu.pid     the process, for a feosd that starts again
    late-snapshot  the marker of a snapshot past its timeout (survives a restart)
    jail.json    what a deletion undoes

QEMU is confined as far as it allows: -chroot into the directory and -runas the microVM's own
uid once it has opened its files, and -sandbox (seccomp) with spawning denied: the suspend and
resume hand QEMU the snapshot's file descriptor (`getfd` over QMP, `-incoming fd:N`), so QEMU
never needs a shell or a file inside its chroot. elevateprivileges=deny is left off: QEMU 7.2
installs the filter before -runas switches user, so the filter kills its own setuid (SIGSYS).

A process is followed by its pidfd: readable when QEMU ends, whether feosd started it or took it
over after a restart. Its end says how the microVM ended: exit 0 or a SHUTDOWN event that the
guest caused is stopped; a signal, another code, or an end without a guest SHUTDOWN is crashed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from feos._reaper import REAPER
from feos.errors import Code, FeosError, busy

from ._driver import Adopted, Exit, VmHandle, VmState
from ._jail import _set_tap_owner
from ._qemu_argv import (
    QBOOT,
    Drive,
    QemuConfig,
    Tap,
    host_tsc_khz,
    kernel_cmdline,
    microvm_firmware,
    qemu_argv,
)
from ._qmp import Qmp, backoff, connect_qmp, until

log = logging.getLogger("feos.vmm.qemu")

LATE_MARKER = "late-snapshot"
SNAPSHOT_FILE = "memory"
MAX_BANDWIDTH = 1 << 40  # bytes/s: QEMU's default cap (128 MiB/s) would make a suspend 10x slower
QMP_WITHIN_S = 5.0
LINK_WITHIN_S = 1.0  # a resume: until QEMU took the guest link's connection, before `cont`
LINK_CHARDEV = "guest"  # the guest link's -chardev id (_qemu_argv)
# The most a QMP wait pauses between looks (see _qmp's "Waiting for QEMU"). A migration's end
# comes as a MIGRATION event (the pause only backs it up); QEMU's socket and the guest link's
# connection come without any, on the resume's path: there the pause stays short.
MIGRATION_PAUSE_S = 0.05
SOCKET_PAUSE_S = 0.01
MIGRATION_EVENTS = {"capabilities": [{"capability": "events", "state": True}]}


@attrs.define
class _Live:
    """A QEMU process the driver follows."""

    pid: int
    pidfd: int
    qmp: Qmp | None = None
    exit: Exit | None = None
    ended: trio.Event = attrs.field(factory=trio.Event)
    reaping: bool = False
    released: trio.Event = attrs.field(factory=trio.Event)


def exit_of(code: int | None, signo: int | None, guest_shutdown: bool) -> Exit:
    """How a QEMU process ended, from its status where known and the SHUTDOWN it announced."""
    if signo is not None:
        return Exit(VmState.CRASHED, f"QEMU was killed by signal {signo}")
    if code == 0 or (code is None and guest_shutdown):
        return Exit(VmState.STOPPED, "the guest shut down")
    if code is None:
        return Exit(VmState.CRASHED, "QEMU ended without the guest shutting down")
    return Exit(VmState.CRASHED, f"QEMU exited with status {code}")


def cmdline_names(cmdline: bytes, vm_id: str) -> bool:
    """Whether a /proc/<pid>/cmdline is QEMU's of this microVM (and not a reused pid)."""
    words = cmdline.split(b"\0")
    return bool(words) and b"qemu" in words[0] and f"feos-{vm_id}".encode() in words


class QemuDriver:
    """Implements feos.vmm._driver.Driver for QEMU's microvm machine."""

    name = "qemu"

    def __init__(
        self,
        state_dir: Path,
        *,
        qemu: str = "qemu-system-x86_64",
        confine: bool = True,
        tsc_khz: int | None = None,
        max_bandwidth: int = MAX_BANDWIDTH,
    ) -> None:
        self._max_bandwidth = max_bandwidth
        self._root = Path(state_dir) / "vms" / "qemu"
        found = shutil.which(qemu)
        self._qemu = found or qemu
        self._confine = confine
        self._tsc_khz = tsc_khz if tsc_khz is not None else host_tsc_khz()
        self._live: dict[str, _Live] = {}
        self._version: str | None = None
        self._firmware: tuple[str | None] | None = None

    # -- paths and config -----------------------------------------------------------------

    def directory(self, vm_id: str) -> Path:
        return self._root / vm_id

    def guest_link(self, vm: VmHandle) -> Path:
        return vm.directory / "guest.sock"

    def snapshot_file(self, vm: VmHandle) -> Path:
        return vm.directory / "snapshot" / SNAPSHOT_FILE

    def version(self) -> str:
        """"qemu <version>": a snapshot loads only into the QEMU that wrote it."""
        if self._version is None:
            try:
                out = subprocess.run([self._qemu, "--version"], capture_output=True, text=True,
                                     timeout=10, check=True).stdout
            except (OSError, subprocess.SubprocessError) as exc:
                raise FeosError(Code.FAILED_PRECONDITION,
                                f"QEMU ({self._qemu}) does not answer --version: {exc}") from None
            words = out.split()
            self._version = "qemu " + (words[3] if len(words) > 3 else out.strip())
        return self._version

    def late_snapshot(self, vm: VmHandle) -> bool:
        return (vm.directory / LATE_MARKER).exists()

    def runs_with(self) -> bool:
        """Whether this QEMU takes -run-with chroot=,user= in place of -chroot and -runas
        (9.1 removed those: Debian 13's QEMU)."""
        try:
            major, minor = (int(x) for x in self.version().split()[-1].split(".")[:2])
        except (ValueError, FeosError):
            return False
        return (major, minor) >= (9, 1)

    def firmware(self) -> str | None:
        """The microVMs' firmware: qboot where this QEMU has it (Debian 12's default for
        microvm, not Debian 13's), else None, QEMU's default with its option ROMs."""
        if self._firmware is None:
            try:
                dirs = subprocess.run([self._qemu, "-L", "help"], capture_output=True,
                                      text=True, timeout=10, check=True).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                dirs = []
            found = microvm_firmware(dirs)
            if found is None:
                log.warning("QEMU (%s) has no %s in its data directories %s: microVMs boot "
                            "through its default firmware and option ROMs", self._qemu, QBOOT,
                            dirs)  # fmt: skip
            self._firmware = (found,)
        return self._firmware[0]

    def config(self, vm: VmHandle, *, chroot: bool) -> QemuConfig:
        """Paths are relative to the directory, QEMU's working directory before its chroot and
        its root after: a file QEMU opens again (a drive's reopen read-only when a snapshot
        inactivates it) is then found on either side of the chroot."""
        drives = [Drive("root.erofs", "root", read_only=True)]
        if vm.spec.data_disk is not None:
            drives.append(Drive("data", "data", format=vm.spec.data_format))
        formats = vm.spec.volume_formats
        drives += [Drive(f"volume{i}", f"vol{i + 1}",
                         format=formats[i] if i < len(formats) else "raw")
                   for i in range(len(vm.spec.volumes))]
        tap = None
        if vm.spec.tap is not None:
            tap = Tap(vm.spec.tap, vm.spec.mac or "06:00:00:00:00:01")
        confine = self._confine and os.geteuid() == 0
        return QemuConfig(
            kernel="vmlinux", initramfs="initramfs",
            cmdline=kernel_cmdline(self._tsc_khz, "feos.guest", *vm.spec.kernel_extra),
            vcpus=vm.spec.vcpus, memory_mib=vm.spec.memory_mib, drives=tuple(drives),
            link_socket="guest.sock", tap=tap, qmp_socket="qmp.sock",
            serial_log=None, accel="kvm" if vm.accel == "kvm" else "tcg",
            chroot=str(vm.directory) if confine and chroot else None,
            runas=f"{vm.uid}:{vm.uid}" if confine and vm.uid is not None else None,
            run_with=confine and self.runs_with(), firmware=self.firmware(),
            sandbox=False, name=f"feos-{vm.id}", qemu=self._qemu,
        )  # fmt: skip

    def argv(self, vm: VmHandle, *, chroot: bool = True) -> list[str]:
        """The builder's argv with this driver's console and sandbox (a thin wrapper over it)."""
        argv = qemu_argv(self.config(vm, chroot=chroot))
        # The console: stdin is console.in (a FIFO), stdout serial.log; the builder's -serial
        # file: has no input side.
        i = argv.index("-serial")
        argv[i : i + 2] = ["-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console"]
        if self._confine and os.geteuid() == 0:
            argv += ["-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny"]
        return argv

    # -- prepare ----------------------------------------------------------------------------

    async def prepare(self, vm: VmHandle) -> None:
        await trio.to_thread.run_sync(self._prepare, vm)

    def _prepare(self, vm: VmHandle) -> None:
        d = vm.directory
        d.mkdir(parents=True, exist_ok=True)
        (d / "snapshot").mkdir(exist_ok=True)
        links: list[str] = []
        for name in ("vmlinux", "initramfs", "root.erofs"):
            _link(vm.guest_dir / name, d / name, hard=True)
            links.append(name)
        disks = [("data", vm.spec.data_disk)] if vm.spec.data_disk is not None else []
        disks += [(f"volume{i}", v) for i, v in enumerate(vm.spec.volumes)]
        owners: dict[str, list[int]] = {}
        inside = True  # every disk is a file of the directory: QEMU may chroot into it
        for name, path in disks:
            inside &= _link(Path(path), d / name, hard=True)
            links.append(name)
            if vm.uid is not None and os.geteuid() == 0:
                st = os.stat(d / name)
                owners[name] = [st.st_uid, st.st_gid]
                os.chown(d / name, vm.uid, vm.uid)  # its reopen runs as the microVM's user
        for path in vm.spec.backing:  # read-only layers, shared: linked, never given away
            name = Path(path).name
            if name not in links:
                inside &= _link(Path(path), d / name, hard=True)
                links.append(name)
        if not inside:
            log.warning("microVM %s: a disk is on another filesystem; QEMU runs without chroot",
                        vm.id)  # fmt: skip
        if not (d / "console.in").exists():
            os.mkfifo(d / "console.in", 0o600)
        (d / "metadata.json").write_text(vm.spec.metadata)
        _write_json(d / "config", self.argv(vm, chroot=inside))
        _write_json(d / "jail.json", {"links": links, "owners": owners, "taps": [],
                                      "uid": vm.uid, "chroot": inside,
                                      "guest_version": vm.guest_version})  # fmt: skip

    # -- start, wait, shutdown ----------------------------------------------------------------

    async def start(self, vm: VmHandle, *, within: float) -> None:
        argv = json.loads((vm.directory / "config").read_text())
        await self._spawn(vm, argv, None, within)

    async def _spawn(self, vm: VmHandle, argv: list[str], incoming: Path | None,
                     within: float) -> None:  # fmt: skip
        d = vm.directory
        with contextlib.suppress(FileNotFoundError):
            (d / "qmp.sock").unlink()
        if vm.spec.tap is not None and vm.uid is not None and os.geteuid() == 0:
            await trio.to_thread.run_sync(give_tap, vm.spec.tap, vm.uid)
        pid = await trio.to_thread.run_sync(_spawn, argv, d, incoming)
        REAPER.claim(pid)  # its status is _reap's (it outlives the thread that spawned it)
        live = _Live(pid, os.pidfd_open(pid))
        self._live[vm.id] = live
        (d / "qemu.pid").write_text(f"{pid}\n")
        try:
            live.qmp = await self._connect(vm, live, within)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._kill(vm.id)
            raise

    async def _connect(self, vm: VmHandle, live: _Live, within: float) -> Qmp:
        """QMP, tried until QEMU has made its socket, within `within`."""
        path = str(vm.directory / "qmp.sock")
        deadline = trio.current_time() + within
        for pause in backoff(SOCKET_PAUSE_S):
            if _exited(live.pidfd):
                exit_ = await self._reap(vm.id, live)
                tail = _tail(vm.directory / "vmm.log")
                raise FeosError(Code.INTERNAL, f"QEMU ended at its start: {exit_.reason}: {tail}")
            try:
                return await connect_qmp(path, within=max(0.1, deadline - trio.current_time()))
            except FeosError:
                if trio.current_time() >= deadline:
                    raise FeosError(
                        Code.UNAVAILABLE, f"QEMU's QMP did not answer within {within}s"
                    ) from None
            await trio.sleep(pause)
        raise AssertionError("backoff() never ends")

    async def wait(self, vm: VmHandle) -> Exit:
        live = self._live.get(vm.id)
        if live is None:
            raise FeosError(Code.FAILED_PRECONDITION, f"microVM {vm.id} has no QEMU")
        return await self._reap(vm.id, live)

    async def _reap(self, vm_id: str, live: _Live) -> Exit:
        """Wait for the end of the process and learn how it ended (once; others wait for it)."""
        while live.reaping:  # another task reaps it: wait for its answer, or its cancellation
            released = live.released
            await released.wait()
        if live.exit is not None:
            return live.exit
        live.reaping = True
        try:
            await trio.lowlevel.wait_readable(live.pidfd)
        except BaseException:
            # A reaper cancelled (a delete cancels the watcher) hands the reaping on.
            live.reaping = False
            live.released.set()
            live.released = trio.Event()
            raise
        code, signo = _waitid(live.pidfd)
        shutdown = False
        if live.qmp is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                with contextlib.suppress(FeosError):
                    await live.qmp.wait_event("__never__")  # drain up to EOF
            event = live.qmp.seen("SHUTDOWN")
            shutdown = event is not None and bool(event.data.get("guest"))
            live.qmp.close()
        live.exit = exit_of(code, signo, shutdown)
        os.close(live.pidfd)
        live.ended.set()
        live.reaping = False
        live.released.set()
        return live.exit

    async def shutdown(self, vm: VmHandle, *, grace: float) -> Exit:
        live = self._need(vm)
        with contextlib.suppress(FeosError):
            assert live.qmp is not None
            await live.qmp.execute("system_powerdown")
        with trio.move_on_after(grace):
            return await self.wait(vm)
        await self._kill(vm.id)
        return Exit(VmState.CRASHED, f"the guest did not power off within {grace:g}s")

    async def _kill(self, vm_id: str) -> None:
        live = self._live.get(vm_id)
        if live is None:
            return
        if not live.ended.is_set():
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(live.pidfd, signal.SIGKILL)
            await self._reap(vm_id, live)

    def close(self) -> None:
        """Let go of every process (they run on, for the next service to take over)."""
        for live in self._live.values():
            if live.qmp is not None:
                live.qmp.close()
            if not live.ended.is_set():
                os.close(live.pidfd)
        self._live.clear()

    def pid(self, vm: VmHandle) -> int | None:
        live = self._live.get(vm.id)
        return None if live is None or live.ended.is_set() else live.pid

    async def settle(self, vm: VmHandle, *, within: float) -> None:
        """Until free page reporting stops shrinking QEMU's memory (200 ms without a drop)."""
        pid = self.pid(vm)
        if pid is None:
            return
        with trio.move_on_after(within):
            low, since = _rss(pid), trio.current_time()
            while trio.current_time() - since < 0.2:
                await trio.sleep(0.05)
                rss = _rss(pid)
                if rss < low:
                    low, since = rss, trio.current_time()

    def _need(self, vm: VmHandle) -> _Live:
        live = self._live.get(vm.id)
        if live is None or live.ended.is_set() or live.qmp is None:
            raise FeosError(Code.FAILED_PRECONDITION, f"microVM {vm.id} is not running")
        return live

    # -- suspend and resume --------------------------------------------------------------------

    async def suspend(self, vm: VmHandle, *, snapshot_timeout: float) -> None:
        live = self._need(vm)
        assert live.qmp is not None
        snap = vm.directory / "snapshot"
        part = snap / f"{SNAPSHOT_FILE}.part"
        await live.qmp.execute("stop")
        await live.qmp.execute("migrate-set-parameters", {"max-bandwidth": self._max_bandwidth})
        await live.qmp.execute("migrate-set-capabilities", MIGRATION_EVENTS)
        snap.mkdir(exist_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await live.qmp.execute("getfd", {"fdname": "snapshot"}, fd=fd)
        finally:
            os.close(fd)
        await live.qmp.execute("migrate", {"uri": "fd:snapshot"})
        with trio.move_on_after(snapshot_timeout):
            await _migrated(live.qmp)
            await self._finish_suspend(vm, live)
            return
        (vm.directory / LATE_MARKER).write_text(json.dumps({"since": time.time()}))
        raise busy(f"QEMU still writes the snapshot of microVM {vm.id} "
                   f"(past its timeout of {snapshot_timeout:g}s)")  # fmt: skip

    async def _finish_suspend(self, vm: VmHandle, live: _Live) -> None:
        """The snapshot is whole: QEMU quits while the file is punched and synced beside it."""
        snap = vm.directory / "snapshot"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._quit, vm, live)
            if (snap / f"{SNAPSHOT_FILE}.part").exists():
                await trio.to_thread.run_sync(_seal, snap / f"{SNAPSHOT_FILE}.part",
                                              snap / SNAPSHOT_FILE)  # fmt: skip

    async def _quit(self, vm: VmHandle, live: _Live) -> None:
        assert live.qmp is not None
        with contextlib.suppress(FeosError):
            await live.qmp.execute("quit")
        with trio.move_on_after(10) as scope:
            await self._reap(vm.id, live)
        if scope.cancelled_caught:
            await self._kill(vm.id)

    async def seed(self, vm: VmHandle, memory: Path) -> None:
        """A template's snapshot as this microVM's: hard-linked (the resume's discard unlinks
        the link only), copied where it is on another filesystem."""
        await trio.to_thread.run_sync(_seed, memory, vm.directory / "snapshot" / SNAPSHOT_FILE)

    async def late_snapshot_done(self, vm: VmHandle) -> None:
        """The late snapshot ended: run the VM again and discard the snapshot and the marker."""
        live = self._need(vm)
        assert live.qmp is not None
        with contextlib.suppress(FeosError):
            await _migrated(live.qmp)
        await live.qmp.execute("cont")
        await trio.to_thread.run_sync(_discard_snapshot, vm.directory)

    async def resume(self, vm: VmHandle, *, within: float,
                     rejoin: Callable[[], Awaitable[bool]] | None = None,
                     running: Callable[[], None] | None = None) -> None:  # fmt: skip
        memory = vm.directory / "snapshot" / SNAPSHOT_FILE
        if not memory.exists():
            raise FeosError(Code.FAILED_PRECONDITION, f"microVM {vm.id} has no snapshot")
        argv = json.loads((vm.directory / "config").read_text())
        # MIGRATION events from the start: the load begins before QMP is connected
        argv += ["-global", "migration.x-events=on", "-S", "-incoming", "fd:INCOMING"]
        began = time.monotonic()
        await self._spawn(vm, argv, memory, within)
        live = self._live[vm.id]
        assert live.qmp is not None
        with trio.fail_after(within):
            status = await _incoming_done(live.qmp)
        if status != "completed":
            await self._kill(vm.id)
            raise FeosError(Code.INTERNAL, f"QEMU could not load the snapshot: {status}")
        loaded = time.monotonic()
        if rejoin is not None and await rejoin():
            # The guest must not see the link down: QEMU tells it so after `cont` unless
            # the port's connection is there again by then (the guest's Cap'n Proto session
            # then goes on, and a ping needs no new hello nor session).
            with trio.move_on_after(LINK_WITHIN_S) as waited:
                await _link_connected(live.qmp)
            if waited.cancelled_caught:
                log.info("microVM %s: QEMU did not take the guest link's connection within "
                         "%gs of the load; the guest will see the link down", vm.id,
                         LINK_WITHIN_S)  # fmt: skip
        rejoined = time.monotonic()
        await live.qmp.execute("cont")
        if running is not None:
            running()  # the guest's ping need not wait for the snapshot's removal
        await trio.to_thread.run_sync(_discard_snapshot, vm.directory)
        log.debug("microVM %s resumed: loaded %.1f ms, link %.1f ms, cont and discard %.1f ms",
                  vm.id, 1000 * (loaded - began), 1000 * (rejoined - loaded),
                  1000 * (time.monotonic() - rejoined))  # fmt: skip

    # -- delete and adopt -----------------------------------------------------------------

    async def delete(self, vm: VmHandle) -> None:
        await self._kill(vm.id)
        if vm.id not in self._live:
            pid = _pid_of(vm.directory)
            # Only this microVM's QEMU: after a host's reboot its old pid may be anyone's.
            if pid is not None and _is_ours(pid, vm.id, vm.directory):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._live.pop(vm.id, None)
        await trio.to_thread.run_sync(_undo_jail, vm.directory)

    async def adopt(self, vm: VmHandle) -> Adopted:
        d = vm.directory
        pid = _pid_of(d)
        alive = pid is not None and _is_ours(pid, vm.id, d)
        if not alive:
            return await self._adopt_gone(vm)
        assert pid is not None
        REAPER.claim(pid)  # still feosd's child after a self-upgrade: its status is _reap's
        live = _Live(pid, os.pidfd_open(pid))
        self._live[vm.id] = live
        try:
            live.qmp = await connect_qmp(str(d / "qmp.sock"), within=QMP_WITHIN_S)
            status = (await live.qmp.execute("query-status"))["status"]
            migration = (await live.qmp.execute("query-migrate")).get("status")
        except FeosError as exc:
            await self._kill(vm.id)
            return Adopted(VmState.CRASHED, f"QEMU did not answer after feosd's restart: {exc}")
        return await self._adopt_alive(vm, live, status, migration)

    async def _adopt_alive(self, vm: VmHandle, live: _Live, status: str,
                           migration: str | None) -> Adopted:  # fmt: skip
        """Decide by QEMU's run state: an outgoing migration leaves it "postmigrate", an
        incoming one (with -S) "paused", one still loading "inmigrate"."""
        d = vm.directory
        snapshot = (d / "snapshot" / SNAPSHOT_FILE).exists()
        if self.late_snapshot(vm) or (migration == "active" and status != "inmigrate"):
            return Adopted(VmState.BUSY, "QEMU still writes a late snapshot", live.pid)
        if status == "inmigrate":  # a resume cut off: the snapshot is still whole
            await self._kill(vm.id)
            return Adopted(VmState.SUSPENDED if snapshot else VmState.CRASHED,
                           "a resume was cut off by feosd's restart")  # fmt: skip
        if status == "postmigrate" and migration == "completed":
            await self._finish_suspend(vm, live)  # feosd ended between the snapshot and quit
            return Adopted(VmState.SUSPENDED, "the suspend was finished after feosd's restart")
        assert live.qmp is not None
        if status in ("paused", "postmigrate", "prelaunch"):
            await live.qmp.execute("cont")
        await trio.to_thread.run_sync(_discard_snapshot, d)
        return Adopted(VmState.RUNNING, "", live.pid)

    async def _adopt_gone(self, vm: VmHandle) -> Adopted:
        d = vm.directory
        if (d / "snapshot" / SNAPSHOT_FILE).exists():
            return Adopted(VmState.SUSPENDED)
        late = self.late_snapshot(vm)
        await trio.to_thread.run_sync(_discard_snapshot, d)
        if late:
            return Adopted(VmState.CRASHED, "QEMU ended while it wrote a late snapshot")
        return Adopted(VmState.CRASHED, "QEMU ended while feosd was away")


# -- blocking helpers (worker threads) -----------------------------------------------------


def _spawn(argv: list[str], d: Path, incoming: Path | None) -> int:
    """QEMU in a session of its own, in its directory, its console on console.in and serial.log.

    posix_spawn, not subprocess: a Popen's finalizer would reap the process, whose end the
    driver reads itself through its pidfd. `env -C` gives it its working directory (relative
    paths: see `config`) and execs QEMU in the same process. "fd:INCOMING" names the snapshot."""
    opened: list[int] = []
    try:
        stdin = os.open(d / "console.in", os.O_RDWR | os.O_CLOEXEC)  # RDWR: never blocks
        opened.append(stdin)
        stdout = os.open(d / "serial.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                         0o600)  # fmt: skip
        opened.append(stdout)
        stderr = os.open(d / "vmm.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)  # fmt: skip
        opened.append(stderr)
        actions = [(os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, stdout, 1),
                   (os.POSIX_SPAWN_DUP2, stderr, 2)]  # fmt: skip
        if incoming is not None:
            fd = os.open(incoming, os.O_RDONLY | os.O_CLOEXEC)
            opened.append(fd)
            actions.append((os.POSIX_SPAWN_DUP2, fd, 3))
            argv = ["fd:3" if a == "fd:INCOMING" else a for a in argv]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        envbin = shutil.which("env") or "/usr/bin/env"
        return os.posix_spawn(envbin, [envbin, "-C", str(d), *argv], env,
                              file_actions=actions, setsid=True)  # fmt: skip
    finally:
        for fd in opened:
            os.close(fd)


def give_tap(tap: str, uid: int) -> None:
    """The pod's TAP to the microVM's user and its group (the same number), if it is not
    theirs yet: the network makes it before the microVM, and its uid, exist."""
    sysfs = Path(f"/sys/class/net/{tap}")
    with contextlib.suppress(FileNotFoundError):  # no TAP: QEMU says so at its start
        owner = [(sysfs / f).read_text().strip() for f in ("owner", "group")]
        if owner != [str(uid), str(uid)]:
            _set_tap_owner(tap, uid, uid)


def _waitid(pidfd: int) -> tuple[int | None, int | None]:
    """(exit code, signal) of an ended child; (None, None) for a process not ours to reap."""
    try:
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        return None, None
    if info is None:
        return None, None
    if info.si_code == os.CLD_EXITED:
        return info.si_status, None
    return None, info.si_status


def _exited(pidfd: int) -> bool:
    import select

    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _pid_of(d: Path) -> int | None:
    try:
        return int((d / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _is_ours(pid: int, vm_id: str, d: Path) -> bool:
    """A live QEMU of this microVM: its name, and its root (chrooted) or working directory."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        places = {os.readlink(f"/proc/{pid}/root"), os.readlink(f"/proc/{pid}/cwd")}
    except OSError:
        return False
    state = stat.rpartition(")")[2].split()[0]
    return state not in ("Z", "X") and cmdline_names(cmdline, vm_id) and str(d) in places


def _link(src: Path, dst: Path, *, hard: bool) -> bool:
    """Link src in as dst: hard if it can (True), else a symlink (False)."""
    with contextlib.suppress(FileNotFoundError):
        dst.unlink()
    if hard:
        try:
            os.link(src.resolve(), dst)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    dst.symlink_to(src)
    return False


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _seal(src: Path, dst: Path) -> None:
    """The zero pages punched out, then the file named: a memory file is whole.

    Not fsynced: the kernel writes the snapshot back as it writes back any page cache (the
    spec's records are synced; a snapshot's memory is what "the disk writes back" meanwhile),
    and FeOS keeps /var/lib/feos on a tmpfs, where a sync is moot."""
    punch_zeros(src)
    src.replace(dst)


def _seed(memory: Path, dst: Path) -> None:
    dst.parent.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        dst.unlink()
    try:
        os.link(memory, dst)
    except FileNotFoundError:
        why = f"the template's snapshot {memory} is gone"
        raise FeosError(Code.FAILED_PRECONDITION, why) from None
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(memory, dst)


def _undo_jail(d: Path) -> None:
    """What jail.json records: the disks' owners given back; then the directory goes."""
    try:
        jail = json.loads((d / "jail.json").read_text())
    except (OSError, ValueError):
        jail = {}
    for name, (uid, gid) in jail.get("owners", {}).items():
        with contextlib.suppress(OSError):
            os.chown(d / name, uid, gid)
    shutil.rmtree(d, ignore_errors=True)


def _discard_snapshot(d: Path) -> None:
    """The snapshot renamed away at once, and unlinked on a thread of its own: freeing the
    blocks of a large file takes long, and nothing waits for it."""
    for name in (f"{SNAPSHOT_FILE}.part", SNAPSHOT_FILE):
        trash = d / "snapshot" / f".discarded-{name}-{time.monotonic_ns()}"
        try:
            (d / "snapshot" / name).rename(trash)
        except FileNotFoundError:
            continue
        threading.Thread(target=trash.unlink, args=(True,), name="unlink", daemon=True).start()
    with contextlib.suppress(FileNotFoundError):
        (d / LATE_MARKER).unlink()


def _tail(path: Path, n: int = 400) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace").strip()
    except OSError:
        return ""


_BLOCK = 4096
_ZERO_BLOCK = bytes(_BLOCK)


def zero_runs(data: bytes, base: int = 0) -> list[tuple[int, int]]:
    # The obvious version, kept as the reference the fast search is tested against.
    """The (offset, length) runs of whole 4 KiB blocks of zeroes in `data` (at file offset base)."""
    runs: list[tuple[int, int]] = []
    view = memoryview(data)
    start = None
    for off in range(0, len(data) - _BLOCK + 1, _BLOCK):
        if view[off : off + _BLOCK] == _ZERO_BLOCK:
            start = off if start is None else start
        elif start is not None:
            runs.append((base + start, off - start))
            start = None
    if start is not None:
        end = len(data) - len(data) % _BLOCK
        runs.append((base + start, end - start))
    return runs


def punch_zeros(path: Path) -> int:
    """Punch holes over the file's 4 KiB blocks of zeroes; returns the bytes punched.

    QEMU's migration stream already leaves zero pages out; what it writes of zeroes (a page
    that became zero while being sent) is punched here as the spec's memory file is. The file is
    searched through a mapping for runs of 4 KiB of zeroes (bytes.find, at memory speed), and
    only the aligned blocks inside a run are punched."""
    size = path.stat().st_size
    if size < _BLOCK:
        return 0
    punched = 0
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            for start, length in _aligned_zero_runs(view, size):
                _punch(fd, start, length)
                punched += length
    finally:
        os.close(fd)
    return punched


def _aligned_zero_runs(view: mmap.mmap, size: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    pos = 0
    while (found := view.find(_ZERO_BLOCK, pos)) >= 0:
        start = -(-found // _BLOCK) * _BLOCK
        end = start
        while end + _BLOCK <= size and view[end : end + _BLOCK] == _ZERO_BLOCK:
            end += _BLOCK
        if end > start:
            runs.append((start, end - start))
            pos = end
        else:
            pos = start + 1  # the run found holds no aligned block: look past its first one
    return runs


def _punch(fd: int, offset: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
    rc = libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE,
                        ctypes.c_long(offset), ctypes.c_long(length))  # fmt: skip
    if rc != 0:
        err = ctypes.get_errno()
        if err != errno.EOPNOTSUPP:
            raise OSError(err, os.strerror(err))


async def _migrated(qmp: Qmp) -> str:
    """Until the outgoing migration ends (MIGRATION events wake the look); its status."""

    async def ended() -> str | None:
        info = await qmp.execute("query-migrate")
        status = info.get("status", "none")
        if status not in ("completed", "failed", "cancelled"):
            return None
        if status != "completed":
            why = info.get("error-desc", "")
            raise FeosError(Code.INTERNAL, f"QEMU's snapshot {status}: {why}")
        return str(status)

    return await until(qmp, ended, "MIGRATION", most=MIGRATION_PAUSE_S)


async def _link_connected(qmp: Qmp) -> None:
    """Until QEMU has accepted a connection on the guest link's socket (no event says so)."""

    async def connected() -> bool | None:
        for chardev in await qmp.execute("query-chardev"):
            if chardev.get("label") == LINK_CHARDEV:
                if not str(chardev.get("filename", "")).startswith("disconnected:"):
                    return True
        return None

    await until(qmp, connected, most=SOCKET_PAUSE_S)


async def _incoming_done(qmp: Qmp) -> str:
    """Until an incoming migration has loaded (the VM waits, paused by -S)."""

    async def loaded() -> str | None:
        status = (await qmp.execute("query-status"))["status"]
        if status == "inmigrate":
            return None
        migration = (await qmp.execute("query-migrate")).get("status", "none")
        return "completed" if migration == "completed" else f"{status}/{migration}"

    return await until(qmp, loaded, "MIGRATION", most=MIGRATION_PAUSE_S)
