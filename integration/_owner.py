"""The owner of what a test harness or a benchmark starts and makes: all of it ends with it.

A harness (integration/podnet.py, integration/feosd_proc.py, bench/*.py) that is killed by
SIGTERM (as `timeout` and CI end a run) or that fails half-way must leave no process, namespace,
mount or directory behind: leftovers of earlier runs (QEMUs, feosd, registries, dnsmasq) halve
the speed of the next benchmarks and meet the next tests' names. So:

- `exit_on_sigterm()` makes SIGTERM and SIGHUP do what Ctrl-C does: the SIGINT handler in place
  runs (Python's raises KeyboardInterrupt; trio's raises it at a safe point of its loop; pytest
  then tears its fixtures down), so every `finally`, context manager and atexit hook runs.
  `terminated()` says whether that is why the run ends (`main()` exits with 128+15 then).
- `OWNER.popen(argv)` starts a helper in a session (and so a process group) of its own, which
  the owner kills whole at the end, and with PR_SET_PDEATHSIG (`setpriv --pdeathsig KILL`), so a
  harness killed by SIGKILL still takes its direct children along. The death signal follows the
  thread that forked, so it is set only for helpers started from the main thread.
- `OWNER.netns(name)`, `OWNER.directory(path)`, `OWNER.state_dir(path)` and `OWNER.process(pid)`
  register a namespace to delete, a directory to remove, a feosd state directory whose microVMs
  to kill (feosd's QEMU processes outlive feosd by design, a session of their own, so ending
  feosd is not enough) and a process started otherwise. `OWNER.done(x)` undoes one of them now,
  `OWNER.forget(x)` drops one that its harness ended itself.
- `OWNER.close()` undoes everything in the reverse order it was made; it runs at exit (atexit)
  for whatever a harness did not end itself, and is idempotent.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_TERMINATED: list[int] = []


def _on_signal(signo: int, frame: Any) -> None:
    _TERMINATED.append(signo)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)  # trio's (KI at a safe point) or Python's (KeyboardInterrupt)
    else:
        raise SystemExit(128 + signo)


def exit_on_sigterm() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (cleanups run); call it in the main thread."""
    for signo in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signo, _on_signal)


def terminated() -> bool:
    return bool(_TERMINATED)


def main(run: Callable[[], int | None]) -> int:
    """run() as a script's main: SIGTERM ends it with cleanups, and exit code 143."""
    exit_on_sigterm()
    try:
        return run() or 0
    except KeyboardInterrupt:
        if not terminated():
            raise
        return 128 + _TERMINATED[0]


def qemu_pids(state_dir: Path) -> dict[str, int]:
    """The live QEMU processes of a feosd state directory, by microVM ID (from their qemu.pid)."""
    found = {}
    for pidfile in state_dir.glob("vms/*/*/qemu.pid"):
        try:
            pid = int(pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (ValueError, IndexError, OSError):
            continue
        if b"qemu-system" in cmdline and pidfile.parent.name.encode() in cmdline:
            found[pidfile.parent.name] = pid
    return found


def kill_and_wait(pid: int, timeout: float = 10) -> None:
    """SIGKILL, then until the process is gone or a zombie (its parent, or init, reaps it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return
        except (OSError, IndexError):
            return
        time.sleep(0.02)


def terminate(proc: subprocess.Popen[Any], timeout: float) -> int:
    """SIGTERM, and SIGKILL once `timeout` passed; the exit status (a harness's stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def kill_now(proc: subprocess.Popen[Any] | None) -> None:
    """kill -9 of a harness's process, if it runs."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def end_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL to a helper's process group (it and what it started), the helper reaped. No
    SIGTERM first: a harness that ends wants no feosd that suspends its pods on the way out."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Owner:
    """What was started and made, undone in reverse order by close()."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A helper in a session of its own, ended (its whole group) at the owner's close."""
        if threading.current_thread() is threading.main_thread():
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self._add(proc, lambda: end_group(proc))
        return proc

    def netns(self, name: str) -> str:
        """A network namespace made, deleted at the close (its links go with it)."""
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        self._add(name, lambda: _delete_netns(name))
        return name

    def directory(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        self._add(path, lambda: shutil.rmtree(path, ignore_errors=True))
        return path

    def state_dir(self, path: Path) -> Path:
        """A feosd state directory: its microVMs' QEMUs are killed at the close."""
        self._add(path, lambda: _end_microvms(path))
        return path

    def run_dir(self, path: Path) -> Path:
        """A feosd run directory: the mesh's wireguard-go (which outlives feosd by design)
        killed at the close."""
        self._add(path, lambda: _end_wireguard_go(path))
        return path

    def disk_state(self, path: Path) -> Path:
        """A diskd state directory: its exports (qemu-storage-daemon processes of their own
        session, outliving diskd by design) killed and their FUSE mounts gone at the close."""
        self._add(path, lambda: _end_exports(path))
        return path

    def process(self, pid: int) -> int:
        """A process started otherwise (posix_spawn, a daemon): killed at the close."""
        self._add(pid, lambda: kill_and_wait(pid))
        return pid

    def undo(self, what: object, undo: Callable[[], None]) -> object:
        """Anything else a harness made (a podman pod, a mount): `undo` at the close."""
        self._add(what, undo)
        return what

    def forget(self, what: object) -> None:
        """A harness ended it itself: nothing left to undo."""
        with self._lock:
            self._undo = [(w, u) for w, u in self._undo if w is not what and w != what]

    def done(self, what: object) -> None:
        """Undo one thing now (a harness's own close), and forget it."""
        with self._lock:
            undo = [u for w, u in self._undo if w is what or w == what]
        for u in reversed(undo):
            u()
        self.forget(what)

    def close(self) -> None:
        with self._lock:
            undo, self._undo = self._undo, []
        for _, u in reversed(undo):
            with contextlib.suppress(Exception):
                u()

    def _add(self, what: object, undo: Callable[[], None]) -> None:
        with self._lock:
            self._undo.append((what, undo))


def _delete_netns(name: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split():  # fmt: skip
        kill_and_wait(int(pid))
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _end_microvms(state_dir: Path) -> None:
    for pid in qemu_pids(state_dir).values():
        kill_and_wait(pid)


def _end_wireguard_go(run_dir: Path) -> None:
    with contextlib.suppress(ValueError, OSError):
        pid = int((run_dir / "mesh" / "wireguard-go.pid").read_text().split()[0])
        if b"wireguard-go" in Path(f"/proc/{pid}/cmdline").read_bytes():
            kill_and_wait(pid)


def _end_exports(state_dir: Path) -> None:
    for pidfile in state_dir.glob("disks/*/qsd.pid"):
        with contextlib.suppress(ValueError, OSError, IndexError):
            pid = int(pidfile.read_text().split()[0])
            if b"qemu-storage-daemon" in Path(f"/proc/{pid}/cmdline").read_bytes():
                kill_and_wait(pid)
    for mount in state_dir.glob("disks/*/export.raw"):
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


OWNER = Owner()
atexit.register(OWNER.close)


@contextlib.contextmanager
def kept_dir(prefix: str, keep: bool) -> Iterator[str]:
    """A benchmark's temporary directory under /var/tmp, removed at its end unless `keep`
    (then left in place and named)."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")
    try:
        yield tmp
    finally:
        if keep:
            print(f"kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
