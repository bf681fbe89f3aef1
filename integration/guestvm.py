"""A test harness that boots an installed guest version under QEMU (not a test file).

Used by the integration tests of the guest image and of the agent, and by bench/guest_boot.py.
Import it with integration/ on sys.path (pytest puts it there for the tests in integration/):

    from guestvm import GuestVM, installed_guest

    guest = installed_guest()                  # the newest in $FEOS_GUEST_DIR or the default
    with GuestVM.boot(guest, tmp_path) as vm:  # root.erofs + a fresh data disk, the link socket
        vm.wait_console("FEOS-INIT: starting the agent", timeout=60)
        sock = vm.connect_link(timeout=10)     # a connected blocking socket to guest.sock
        hello = vm.read_line(sock, timeout=30) # b"FEOS-GUEST 1 <boot-id> <session>\\n"
    # leaving the block kills QEMU (if it still runs) and removes nothing from tmp_path

`GuestVM.boot(guest, workdir, *, floor=None, data=True, volumes=(), vcpus=1, memory_mib=512,
tap=None, cmdline=(), timeout=60.0, cpu=None)`:
- `guest` is a Guest (installed_guest() or Guest.at(dir)); `workdir` a directory the VM's files
  go into: guest.sock (the link), qmp.sock, serial.log, data.img (unpacked from data.img.zst with
  `zstd -d`, sparse), qemu.log (QEMU's own stderr).
- `floor` "shell" or "python" adds feos.floor=...; `data=False` boots without a data disk;
  `volumes` are disk file paths, given as vol1, vol2, ...; `tap` a feos.vmm._qemu_argv.Tap;
  `cmdline` extra kernel words; `cpu` QEMU's -cpu (default: max under TCG); `timeout` bounds the whole VM's life: the process is killed after
  it (every boot has one: a TCG boot can hang).
- `vm.started` is time.monotonic() just before QEMU was started; every wait returns the seconds
  since then, so a caller times a boot without a clock of its own.

Methods: `wait_console(text, timeout) -> float` (text seen in serial.log), `console() -> str`,
`wait_exit(timeout) -> int` (QEMU's exit code), `connect_link(timeout) -> socket.socket`,
`read_line(sock, timeout) -> bytes`, `wait_link(timeout) -> Path` (guest.sock exists, for a client
of your own to dial), `qmp(timeout) -> Qmp` (`.execute(cmd, **args)`, `.close()`),
`kill()`. `GuestVM(config, workdir, timeout)` starts QEMU from a QemuConfig of your own (as
`attrs.evolve(vm.config, incoming=...)` for a resume). Async variants for trio tests, bounded by the VM's
life (and by the caller's trio.fail_after): `await vm.wait_console_async(text)`,
`await vm.wait_exit_async()`. A wait that times out raises TimeoutError with the console's tail,
so a failing test shows what the guest said.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import attrs
from _owner import OWNER

from feos.vmm._qemu_argv import Drive, QemuConfig, Tap, host_tsc_khz, kernel_cmdline, qemu_argv

DEFAULT_GUEST_DIR = "/usr/lib/feos/guest"
LINK_NAME = "feos.guest"
_POLL = 0.01


@attrs.frozen
class Guest:
    """One installed guest version: its directory and manifest."""

    dir: Path
    manifest: dict[str, object]

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> Guest:
        d = Path(path)
        return cls(d, json.loads((d / "manifest.json").read_text()))

    @property
    def version(self) -> str:
        return str(self.manifest["version"])


def guest_dir() -> Path:
    return Path(os.environ.get("FEOS_GUEST_DIR", DEFAULT_GUEST_DIR))


def installed_guest(version: str | None = None) -> Guest:
    """The given version, or the newest installed one: the greatest by (built, version)."""
    base = guest_dir()
    if version is not None:
        return Guest.at(base / version)
    guests = [Guest.at(d) for d in base.iterdir() if (d / "manifest.json").is_file()]
    if not guests:
        raise FileNotFoundError(f"no guest version installed in {base} (run hack/guest-image)")
    return max(guests, key=lambda g: (str(g.manifest.get("built", "")), g.version))


class GuestVM:
    """A booted guest; see the module's docstring."""

    def __init__(self, config: QemuConfig, workdir: Path, timeout: float) -> None:
        self.config = config
        self.workdir = workdir
        self.link_path = workdir / "guest.sock"
        self.qmp_path = workdir / "qmp.sock"
        self.serial_log = workdir / "serial.log"
        self.deadline_s = timeout
        self._stderr = (workdir / "qemu.log").open("wb")
        self.started = time.monotonic()
        self.proc = OWNER.popen(qemu_argv(config), stdin=subprocess.DEVNULL,
                                stdout=self._stderr, stderr=self._stderr)  # fmt: skip

    @classmethod
    def boot(
        cls,
        guest: Guest,
        workdir: str | os.PathLike[str],
        *,
        floor: str | None = None,
        data: bool = True,
        volumes: Sequence[str | os.PathLike[str]] = (),
        vcpus: int = 1,
        memory_mib: int = 512,
        tap: Tap | None = None,
        cmdline: Sequence[str] = (),
        timeout: float = 60.0,
        cpu: str | None = None,
    ) -> GuestVM:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        for name in ("guest.sock", "qmp.sock", "serial.log"):
            (work / name).unlink(missing_ok=True)
        drives = [Drive(str(guest.dir / "root.erofs"), "root", read_only=True)]
        if data:
            drives.append(Drive(str(unpack_data(guest, work / "data.img")), "data"))
        drives += [Drive(str(Path(v).resolve()), f"vol{i}") for i, v in enumerate(volumes, 1)]
        words = [*([f"feos.floor={floor}"] if floor else []), *cmdline]
        config = QemuConfig(
            kernel=str(guest.dir / "vmlinux"), initramfs=str(guest.dir / "initramfs"),
            cmdline=kernel_cmdline(host_tsc_khz(), LINK_NAME, *words),
            vcpus=vcpus, memory_mib=memory_mib, drives=tuple(drives),
            link_socket=str(work / "guest.sock"), link_name=LINK_NAME, tap=tap,
            qmp_socket=str(work / "qmp.sock"), serial_log=str(work / "serial.log"), cpu=cpu,
        )  # fmt: skip
        return cls(config, work, timeout)

    def __enter__(self) -> GuestVM:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()

    def kill(self) -> None:
        """End QEMU (SIGKILL if it still runs) and reap it; idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        OWNER.forget(self.proc)
        self._stderr.close()

    def console(self) -> str:
        try:
            return self.serial_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _left(self, timeout: float) -> float:
        """Seconds this wait may take: its own timeout, within the VM's life."""
        return min(timeout, self.started + self.deadline_s - time.monotonic())

    def _timeout(self, what: str) -> TimeoutError:
        self.kill()
        tail = "\n".join(self.console().splitlines()[-25:])
        took = time.monotonic() - self.started
        return TimeoutError(f"{what} after {took:.1f}s; console:\n{tail}")

    def _seen(self, text: str) -> bool | None:
        """True when the console holds text; None when QEMU ended without it."""
        if text in self.console():
            return True
        if self.proc.poll() is not None:
            return text in self.console() or None
        return False

    def wait_console(self, text: str, timeout: float = 60.0) -> float:
        end = time.monotonic() + self._left(timeout)
        while time.monotonic() < end:
            seen = self._seen(text)
            if seen:
                return time.monotonic() - self.started
            if seen is None:
                raise self._timeout(f"QEMU ended ({self.proc.returncode}) without {text!r}")
            time.sleep(_POLL)
        raise self._timeout(f"no {text!r} on the console")

    async def wait_console_async(self, text: str) -> float:
        import trio

        end = time.monotonic() + self._left(self.deadline_s)
        while time.monotonic() < end:
            seen = self._seen(text)
            if seen:
                return time.monotonic() - self.started
            if seen is None:
                raise self._timeout(f"QEMU ended ({self.proc.returncode}) without {text!r}")
            await trio.sleep(_POLL)
        raise self._timeout(f"no {text!r} on the console")

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(max(self._left(timeout), 0))
        except subprocess.TimeoutExpired:
            raise self._timeout("QEMU did not end") from None

    async def wait_exit_async(self) -> int:
        import trio

        end = time.monotonic() + self._left(self.deadline_s)
        while (rc := self.proc.poll()) is None:
            if time.monotonic() >= end:
                raise self._timeout("QEMU did not end")
            await trio.sleep(_POLL)
        return rc

    def connect_link(self, timeout: float = 10.0) -> socket.socket:
        """A blocking socket connected to the link (QEMU listens once it has started)."""
        return self.connect_unix(self.link_path, timeout)

    def wait_link(self, timeout: float = 10.0) -> Path:
        """Until QEMU listens on guest.sock, seen in /proc/net/unix rather than by connecting
        (a connection is a session); between its bind and its listen a connect is refused."""
        end = time.monotonic() + self._left(timeout)
        while not _listening(self.link_path):
            if self.proc.poll() is not None or time.monotonic() >= end:
                raise self._timeout(f"no socket at {self.link_path}")
            time.sleep(_POLL)
        return self.link_path

    def qmp(self, timeout: float = 10.0) -> Qmp:
        """A QMP session on qmp.sock (close it when done)."""
        return Qmp(self, timeout)

    def connect_unix(self, path: Path, timeout: float) -> socket.socket:
        end = time.monotonic() + self._left(timeout)
        while time.monotonic() < end:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.proc.poll() is not None:
                    raise self._timeout(f"QEMU ended before {path.name} was up") from None
                time.sleep(_POLL)
        raise self._timeout(f"no socket at {path}")

    def read_line(self, sock: socket.socket, timeout: float = 30.0) -> bytes:
        """One line from the link (up to and with its newline)."""
        end = time.monotonic() + self._left(timeout)
        buf = b""
        while not buf.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0:
                raise self._timeout(f"no line on the link (read {buf!r})")
            sock.settimeout(min(left, 0.5))
            try:
                chunk = sock.recv(1)  # one byte at a time: what follows the line is not ours
            except TimeoutError:
                continue
            if not chunk:
                raise self._timeout(f"the link closed (read {buf!r})")
            buf += chunk
        return buf


def _listening(path: Path) -> bool:
    """Whether a Unix socket listens at path (/proc/net/unix: flags __SO_ACCEPTCON, 0x10000)."""
    with open("/proc/net/unix") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == str(path) and int(fields[3], 16) & 0x10000:
                return True
    return False


class Qmp:
    """A minimal QMP client (blocking) on the VM's qmp.sock: `execute(cmd, **args) -> return`."""

    def __init__(self, vm: GuestVM, timeout: float = 10.0) -> None:
        self.sock = vm.connect_unix(vm.qmp_path, timeout)
        self.sock.settimeout(timeout)
        self._buf = b""
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, object]:
        while b"\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("QMP closed")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))

    def execute(self, command: str, **arguments: object) -> object:
        msg: dict[str, object] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise RuntimeError(f"QMP {command}: {reply['error']}")
            # an event ({"event": ...}): not ours to answer

    def close(self) -> None:
        self.sock.close()


def unpack_data(guest: Guest, dest: Path) -> Path:
    """A fresh data disk from the version's blank data volume (sparse: zstd writes holes)."""
    subprocess.run(["zstd", "-q", "-d", "-f", "--sparse", str(guest.dir / "data.img.zst"),
                    "-o", str(dest)], check=True)  # fmt: skip
    return dest


if __name__ == "__main__":  # a manual boot: python integration/guestvm.py WORKDIR [floor]
    g = installed_guest()
    with GuestVM.boot(g, sys.argv[1], floor=sys.argv[2] if len(sys.argv) > 2 else None) as vm:
        print(f"QEMU ended {vm.wait_exit(120)} after {time.monotonic() - vm.started:.2f}s")
        print(vm.console()[-2000:])
