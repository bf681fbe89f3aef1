"""The Firecracker driver: a microVM in the jailer, configured and run through its API socket.

Theory of operation (node.md, "A pod's microVM", "Lifecycle").

- prepare: the jail (its user, jail.json), the guest's files linked in, metadata.json,
  config.json, the console FIFO and the logs. No process.
- start: the newest installed Firecracker (recorded in jail.json), the disks linked in as the
  microVM's own, the TAP, the cgroup; the jailer runs in a session of its own (feosd is the
  subreaper, not the session leader) with console.in as stdin and serial.log as stdout, and
  execs Firecracker in the same pid. config.json goes in section by section, then InstanceStart.
- suspend: pause, a Full snapshot into snapshot/ within the snapshot's timeout, the process
  ended, the zero pages punched out. A snapshot not written in time leaves the late-snapshot
  marker in the jail: Firecracker cannot stop in the middle and writes on, so every suspend and
  shutdown is refused as busy until late_snapshot_done saw it answer again, ran the vCPUs again
  and discarded the snapshot. The marker is a file, so a restarted feosd finds it.
- resume: the snapshot's Firecracker version (FAILED_PRECONDITION if it is gone), the snapshot
  loaded with the vCPUs stopped, MMDS put in again, the vCPUs resumed, the snapshot removed.
- delete: the process killed, what jail.json records undone, the cgroup and the directory gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from feos._reaper import REAPER
from feos.errors import Code, FeosError, busy

from . import _cgroup, _jail
from . import _firecracker_config as fcc
from ._driver import Adopted, Exit, VmHandle, VmState
from ._firecracker_api import FirecrackerApi
from ._firecracker_punch import punch_zero_pages
from ._jail import Jail, JailRecord

_EXIT_RE = re.compile(r"exit_code=(\d+)")
GUEST_PORT_SOCKET = _jail.NODE_LISTENS  # vsock: the guest's connections to the host's port 10001
STALL_S = 300.0  # a late snapshot whose memory file does not grow this long has crashed


# Processes let go at a service's close, kept: a dropped trio.Process of a running process would
# warn (its pidfd, its Popen) and could be reaped by subprocess's cleanup behind the next
# service's back. The next service waits for them by pidfd and reaps them (_reap).
_RELEASED: list[trio.Process] = []


def _reap(pidfd: int) -> int | None:
    """The exit code (negative: the signal) of an ended process that is this process's child;
    None when it is not (a feosd before this one started it) or was reaped already."""
    try:
        ended = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        return None
    if ended is None:
        return None
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


def _host_tsc_khz() -> int | None:
    try:
        from ._qemu_argv import host_tsc_khz
    except ImportError:
        return None
    return host_tsc_khz()


class FirecrackerDriver:
    """The driver of feos/vmm/_driver.py for Firecracker."""

    name = "firecracker"
    own_cgroups = True  # the jailer (or the driver at the spawn) puts Firecracker in vms/<id>

    def __init__(self, state: Path, *, cgroups: _cgroup.Layout | None = None,
                 netns: str | None = None, tsc_khz: int | None = None) -> None:
        self.state_dir = state
        self.netns = netns  # tests: the TAP and Firecracker in a namespace of the test's
        self._layout = cgroups
        self._prepared_cgroups = False
        self._tsc_khz = tsc_khz
        self._procs: dict[str, trio.Process] = {}

    # -- paths -----------------------------------------------------------------------------------

    def jail(self, vm_id: str) -> Jail:
        return Jail(self.state_dir, vm_id)

    def directory(self, vm_id: str) -> Path:
        return self.jail(vm_id).root

    def guest_link(self, vm: VmHandle) -> Path:
        return self.directory(vm.id) / GUEST_PORT_SOCKET

    def listen(self, vm: VmHandle) -> socket.socket:
        """The node's end of the guest link: the guest dials the host's vsock port 10001, which
        Firecracker connects to v.sock_10001 in the jail. The socket belongs to the microVM's
        user (Firecracker, jailed, connects) and is bound through the directory's descriptor,
        so that no state directory is too deep for sun_path's 108 bytes."""
        root = self.directory(vm.id)
        uid = self._record(vm.id).uid
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                (root / GUEST_PORT_SOCKET).unlink(missing_ok=True)
                sock.bind(f"/proc/self/fd/{fd}/{GUEST_PORT_SOCKET}")
                os.chown(root / GUEST_PORT_SOCKET, uid, uid)
            finally:
                os.close(fd)
            sock.listen(8)
        except OSError as exc:
            sock.close()
            raise FeosError(Code.INTERNAL, f"microVM {vm.id}: listening on "
                            f"{GUEST_PORT_SOCKET}: {exc.strerror or exc}") from exc
        return sock

    def api(self, vm_id: str, timeout: float = 10.0) -> FirecrackerApi:
        return FirecrackerApi(self.directory(vm_id) / "fc.sock", timeout)

    def late_snapshot(self, vm: VmHandle) -> bool:
        return (self.directory(vm.id) / _jail.LATE_MARKER).exists()

    def _record(self, vm_id: str) -> JailRecord:
        record = self.jail(vm_id).read()
        if record is None:
            raise FeosError(Code.FAILED_PRECONDITION, f"microVM {vm_id} has no jail")
        return record

    # -- create ----------------------------------------------------------------------------------

    async def prepare(self, vm: VmHandle) -> None:
        await trio.to_thread.run_sync(self._prepare_sync, vm)

    create = prepare

    def _prepare_sync(self, vm: VmHandle) -> None:
        jail = self.jail(vm.id)
        record = _jail.make(jail)
        install = _jail.choose()
        record.version, record.firecracker, record.jailer = (
            install.version, str(install.firecracker), str(install.jailer))
        jail.write(record)
        for name in ("vmlinux", "initramfs", "root.erofs"):
            if (vm.guest_dir / name).exists() and not jail.path(name).exists():
                _jail.link_in(jail, record, name, vm.guest_dir / name, disk=False)
        _jail.write_json_file(jail.path("metadata.json"), json.loads(vm.spec.metadata))
        jail.path("metadata.json").chmod(0o644)
        config = fcc.build(self._fc_config(vm, install.version))
        jail.path("config.json").write_bytes(fcc.encode(config))
        _jail.own_file(jail, record, "console.in", fifo=True)
        _jail.own_file(jail, record, "snapshot/")
        jail.path("serial.log").touch()

    def _fc_config(self, vm: VmHandle, version: str) -> fcc.FcConfig:
        formats = {vm.spec.data_format, *vm.spec.volume_formats} - {"raw"}
        if formats:  # diskd serves Firecracker a raw FUSE file of the chain instead
            raise FeosError(Code.INVALID_ARGUMENT,
                            f"Firecracker opens raw disks only, not {', '.join(sorted(formats))}")
        if self._tsc_khz is None:
            self._tsc_khz = _host_tsc_khz() or 0
        initrd = "initramfs" if (vm.guest_dir / "initramfs").exists() else None
        s = vm.spec
        return fcc.FcConfig(
            vcpus=s.vcpus, memory_mib=s.memory_mib, initrd=initrd,
            data="data" if s.data_disk else None,
            volumes=tuple(f"volume{i}" for i in range(1, len(s.volumes) + 1)),
            tap=s.tap, mac=s.mac, tsc_khz=self._tsc_khz or None, kernel_extra=s.kernel_extra,
            version=fcc.parse_version(version) if version != "unknown" else (0, 0, 0))

    # -- the process -----------------------------------------------------------------------------

    def _cgroups(self) -> _cgroup.Layout:
        if self._layout is None:
            self._layout = _cgroup.detect()
        if not self._prepared_cgroups:
            _cgroup.prepare(self._layout)
            self._prepared_cgroups = True
        return self._layout

    def _ready_jail(self, vm: VmHandle, install: _jail.FcInstall, *, boot: bool
                    ) -> tuple[list[str], bool]:
        """Everything a start or resume needs before the jailer runs; its argv, and whether the
        jailer moves Firecracker into its cgroup (else feosd does)."""
        jail = self.jail(vm.id)
        record = self._record(vm.id)
        record.version, record.firecracker, record.jailer = (
            install.version, str(install.firecracker), str(install.jailer))
        jail.write(record)
        _jail.clear_jailer_leftovers(jail)
        disks = [("data", vm.spec.data_disk)] if vm.spec.data_disk else []
        disks += [(f"volume{i}", v) for i, v in enumerate(vm.spec.volumes, 1)]
        for name, source in disks:
            _jail.link_in(jail, record, name, Path(source), disk=True)
        if vm.spec.tap:
            _jail.ensure_tap(jail, record, vm.spec.tap, self.netns)
        layout = self._cgroups()
        record.cgroups = [str(d) for d in _cgroup.vm_dirs(layout, vm.id)]
        jail.write(record)
        _cgroup.create(layout, vm.id, vm.spec.vcpus)
        log = jail.path("vmm.log")
        if boot and log.exists() and log.stat().st_size:
            log.replace(jail.path("vmm.log.1"))  # Firecracker writes its log from offset 0
        _jail.own_file(jail, record, "vmm.log")
        mounts = _cgroup.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        cgroup_args = _cgroup.jailer_args(layout, vm.id, vm.spec.vcpus, mounts)
        argv = _jail.jailer_argv(jail, record, cgroup_args=cgroup_args,
                                 metadata=vm.spec.tap is not None, netns=self._netns_path())
        return argv, cgroup_args is not None

    def _netns_path(self) -> str | None:
        return f"/var/run/netns/{self.netns}" if self.netns else None

    async def _spawn(self, vm: VmHandle, install: _jail.FcInstall, *, boot: bool,
                     within: float) -> None:
        argv, jailer_moves = await trio.to_thread.run_sync(
            lambda: self._ready_jail(vm, install, boot=boot))
        root = self.directory(vm.id)
        serial_flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if boot else os.O_APPEND)
        fds = [os.open(root / "console.in", os.O_RDWR | os.O_CLOEXEC),  # never an EOF
               os.open(root / "serial.log", serial_flags | os.O_CLOEXEC, 0o640),
               os.open(root / "vmm.log", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)]
        try:
            proc = await trio.lowlevel.open_process(
                argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], start_new_session=True)
        finally:
            for fd in fds:
                os.close(fd)
        REAPER.claim(proc.pid)  # trio's Process reads its status, after the spawner thread ends
        self._procs[vm.id] = proc
        try:
            if not jailer_moves:
                _cgroup.add_pid(self._cgroups(), vm.id, proc.pid)
            await self._wait_api(vm.id, proc, within)
        except FeosError:
            await self._kill(vm.id)  # a start that failed leaves no process behind
            raise

    async def _wait_api(self, vm_id: str, proc: trio.Process, within: float) -> None:
        sock = self.directory(vm_id) / "fc.sock"
        with trio.move_on_after(within):
            while True:
                if proc.poll() is not None:
                    raise FeosError(Code.INTERNAL, f"Firecracker of {vm_id} ended at its start "
                                    f"({proc.returncode}): {self._log_tail(vm_id)}")
                if sock.exists():
                    with contextlib.suppress(FeosError):
                        await self.api(vm_id, 1.0).describe()
                        return
                await trio.sleep(0.005)
        raise FeosError(Code.UNAVAILABLE, f"Firecracker of {vm_id} did not answer within "
                        f"{within:g}s: {self._log_tail(vm_id)}")

    def _log_tail(self, vm_id: str, lines: int = 3) -> str:
        try:
            text = (self.directory(vm_id) / "vmm.log").read_text(errors="replace")
        except OSError:
            return "no vmm.log"
        return " | ".join(text.strip().splitlines()[-lines:]) or "vmm.log is empty"

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, vm: VmHandle, *, within: float) -> None:
        # a boot anew: a late snapshot's marker left by a Firecracker that ended is stale
        (self.directory(vm.id) / _jail.LATE_MARKER).unlink(missing_ok=True)
        install = await trio.to_thread.run_sync(_jail.choose)
        await self._spawn(vm, install, boot=True, within=within)
        config = json.loads((self.directory(vm.id) / "config.json").read_bytes())
        api = self.api(vm.id)
        try:
            for method, path, body in fcc.api_calls(config):
                await api.call(method, path, body)
            await api.action("InstanceStart")
        except FeosError:
            await self._kill(vm.id)
            raise

    async def wait(self, vm: VmHandle) -> Exit:
        proc = self._procs.get(vm.id)
        code: int | None
        if proc is not None:
            code = await proc.wait()
            self._procs.pop(vm.id, None)
        else:
            code = await self._wait_adopted(vm.id)
        return self._exit(vm.id, code)

    def _exit(self, vm_id: str, code: int | None) -> Exit:
        if code is None:  # adopted: not our child, its status is in its log
            found = _EXIT_RE.findall(self._log_tail(vm_id, 2))
            code = int(found[-1]) if found else None
        if code == 0:
            return Exit(VmState.STOPPED, "the guest shut down or rebooted")
        if code is None:
            return Exit(VmState.CRASHED, "Firecracker ended without saying how")
        if code < 0:
            return Exit(VmState.CRASHED, f"Firecracker was killed by signal {-code}")
        return Exit(VmState.CRASHED, f"Firecracker exited with {code}: {self._log_tail(vm_id)}")

    def pid(self, vm: VmHandle) -> int | None:
        return self._pid(vm.id)

    def close(self) -> None:
        """Let go of every Firecracker without ending it: the next service adopts them (and,
        in the same process, reaps them by their pidfd)."""
        _RELEASED.extend(self._procs.values())
        self._procs.clear()

    def _pid(self, vm_id: str) -> int | None:
        """Firecracker's pid from the jailer's pid file, if that process is this microVM's."""
        proc = self._procs.get(vm_id)
        if proc is not None and proc.poll() is None:
            return proc.pid
        try:
            pid = int((self.directory(vm_id) / "firecracker.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if b"--id" in cmdline and vm_id.encode() in cmdline else None

    async def _wait_adopted(self, vm_id: str) -> int | None:
        pid = self._pid(vm_id)
        if pid is None:
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        try:
            await trio.lowlevel.wait_readable(pidfd)
            return _reap(pidfd)
        finally:
            os.close(pidfd)

    async def _kill(self, vm_id: str) -> None:
        proc = self._procs.get(vm_id)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            self._procs.pop(vm_id, None)
            return
        pid = self._pid(vm_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await self._wait_adopted(vm_id)

    async def shutdown(self, vm: VmHandle, *, grace: float) -> Exit:
        self._refuse_when_late(vm)
        with contextlib.suppress(FeosError):
            await self.api(vm.id).action("SendCtrlAltDel")
        with trio.move_on_after(grace):
            return await self.wait(vm)
        await self._kill(vm.id)
        return Exit(VmState.CRASHED, f"the guest did not power off within {grace:g}s")

    def _refuse_when_late(self, vm: VmHandle) -> None:
        if self.late_snapshot(vm):
            raise busy(f"Firecracker still writes the snapshot of {vm.id}")

    # -- suspend and resume ----------------------------------------------------------------------

    async def suspend(self, vm: VmHandle, *, snapshot_timeout: float) -> None:
        self._refuse_when_late(vm)
        root = self.directory(vm.id)
        api = self.api(vm.id)
        await api.pause()
        await trio.to_thread.run_sync(self._fresh_snapshot_dir, vm.id)
        with trio.move_on_after(snapshot_timeout) as scope:
            await api.snapshot_create("snapshot/vmstate", "snapshot/memory",
                                      within=snapshot_timeout + 5)
        if scope.cancelled_caught:
            marker = {"since": time.time(), "pid": self._pid(vm.id),
                      "timeout_s": snapshot_timeout}
            await trio.to_thread.run_sync(_jail.write_json_file, root / _jail.LATE_MARKER, marker)
            raise busy(f"Firecracker still writes the snapshot of {vm.id}: not written within "
                       f"{snapshot_timeout:g}s")
        await self._kill(vm.id)
        await trio.to_thread.run_sync(punch_zero_pages, root / "snapshot" / "memory")

    def _fresh_snapshot_dir(self, vm_id: str) -> None:
        jail = self.jail(vm_id)
        snap = jail.path("snapshot")
        if snap.exists():
            shutil.rmtree(snap)
        _jail.own_file(jail, self._record(vm_id), "snapshot/")

    async def late_snapshot_done(self, vm: VmHandle) -> None:
        """Wait for Firecracker to answer again (its API is busy while it writes), then run the
        VM on and discard the snapshot; a memory file that stops growing ends it as crashed."""
        memory = self.directory(vm.id) / "snapshot" / "memory"
        last, since = -1, time.monotonic()
        while True:
            if self._pid(vm.id) is None:
                break  # it ended: nothing runs on
            with contextlib.suppress(FeosError):
                await self.api(vm.id, 2.0).describe()
                await self.api(vm.id).resume()
                break
            blocks = memory.stat().st_blocks if memory.exists() else 0
            if blocks != last:
                last, since = blocks, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                await self._kill(vm.id)
                break
            await trio.sleep(1)
        await trio.to_thread.run_sync(self._fresh_snapshot_dir, vm.id)
        (self.directory(vm.id) / _jail.LATE_MARKER).unlink(missing_ok=True)

    async def resume(self, vm: VmHandle, *, within: float,
                     rejoin: Callable[[], Awaitable[bool]] | None = None,
                     running: Callable[[], None] | None = None) -> None:  # fmt: skip
        # The guest dials the node over vsock: no session is carried across (rejoin unused).
        record = await trio.to_thread.run_sync(self._record, vm.id)
        install = await trio.to_thread.run_sync(_jail.find, record.version)
        await self._spawn(vm, install, boot=False, within=within)
        api = self.api(vm.id, within)
        try:
            await api.snapshot_load("snapshot/vmstate", "snapshot/memory")
            if vm.spec.tap:
                await api.put_mmds(json.loads(vm.spec.metadata))
            await api.resume()
        except FeosError:
            await self._kill(vm.id)  # the snapshot stays for another try
            raise
        if running is not None:
            running()
        await trio.to_thread.run_sync(self._fresh_snapshot_dir, vm.id)

    # -- delete, adopt, state --------------------------------------------------------------------

    async def delete(self, vm: VmHandle) -> None:
        await self._kill(vm.id)
        jail = self.jail(vm.id)
        record = await trio.to_thread.run_sync(jail.read)
        await trio.to_thread.run_sync(_jail.undo, jail)
        dirs = [Path(d) for d in record.cgroups] if record else []
        if self._layout is not None:  # where a hand-over (--vms-cgroup) moved it since
            dirs += [d for d in _cgroup.vm_dirs(self._layout, vm.id) if d not in dirs]
        for _ in range(50):  # the kernel empties a cgroup a moment after its last task's exit
            try:
                await trio.to_thread.run_sync(_cgroup.remove_dirs, dirs)
                return
            except FeosError:
                await trio.sleep(0.02)
        await trio.to_thread.run_sync(_cgroup.remove_dirs, dirs)

    async def adopt(self, vm: VmHandle) -> Adopted:
        root = self.directory(vm.id)
        pid = self._pid(vm.id)
        if pid is not None:
            if self.late_snapshot(vm):
                return Adopted(VmState.BUSY, "Firecracker still writes a late snapshot", pid)
            try:
                got = await self.api(vm.id, 2.0).describe()
            except FeosError as e:
                return Adopted(VmState.BUSY, f"Firecracker does not answer: {e.message}", pid)
            return Adopted(VmState.RUNNING, str(got.get("state", "")), pid)
        if self.late_snapshot(vm):
            return Adopted(VmState.CRASHED, "Firecracker ended while it wrote a late snapshot")
        if (root / "snapshot" / "vmstate").exists():
            return Adopted(VmState.SUSPENDED, "a snapshot in snapshot/")
        if (root / "config.json").exists():
            return Adopted(VmState.CRASHED, "Firecracker ended while feosd was away")
        return Adopted(VmState.CRASHED, "its jail is gone")

    async def state(self, vm: VmHandle) -> VmState:
        """What the directory shows: a process (RUNNING, BUSY), a snapshot (SUSPENDED), a jail
        without either (CREATED), none (DELETED)."""
        found = await self.adopt(vm)
        if found.pid is not None or found.state is VmState.SUSPENDED:
            return found.state
        return VmState.CREATED if (self.directory(vm.id) / "config.json").exists() \
            else VmState.DELETED

    async def balloon_statistics(self, vm: VmHandle) -> dict[str, Any]:
        return await self.api(vm.id).balloon_statistics()
