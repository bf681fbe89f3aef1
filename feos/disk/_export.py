"""The raw data path: a disk's chain exported as one raw file by qemu-storage-daemon over FUSE.

Firecracker opens raw files only, so a disk started for it is served by a process of its own:
qemu-storage-daemon opens the top (and through it the layers beneath, read-only) and exports the
chain at <disk>/export.raw, a FUSE mount over an empty file, with allow_other so that the
microVM's own user opens it (its owner is set to that user: QEMU's export takes a chown). The
daemon runs daemonized (its own session, reparented away from diskd) with its pid in qsd.pid
and its QMP on qmp.sock, so that a restart or a kill -9 of diskd leaves the disk served and the
next diskd adopts it by its pid. No Python runs per I/O: FUSE's requests go to QEMU's block
layer; a flush of the guest (Firecracker's writeback cache) reaches qcow2's flush and fdatasync.

A stop flushes and closes the chain through QMP (the export removed, then the nodes, each close
a flush) before the daemon quits; a daemon that does not answer is ended by SIGTERM (which also
closes and flushes), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from pathlib import Path

import trio

from ..errors import Code, FeosError
from ..vmm import connect_qmp

log = logging.getLogger(__name__)

QSD = "qemu-storage-daemon"
EXPORT = "export.raw"
PIDFILE = "qsd.pid"
QMP = "qmp.sock"
STOP_S = 30.0  # a flush of what the page cache holds of the top may take seconds


def export_argv(directory: Path, top: str, top_format: str) -> list[str]:
    d = directory
    return [
        QSD, "--daemonize", "--pidfile", str(d / PIDFILE),
        # cache.direct=off: writes land in the page cache, the guest's flushes fdatasync them
        "--blockdev", f"driver=file,node-name=file,filename={d / top},cache.direct=off",
        "--blockdev", f"driver={top_format},node-name=disk,file=file",
        "--export", f"type=fuse,id=export,node-name=disk,mountpoint={d / EXPORT},"
                    "writable=on,allow-other=on",
        "--chardev", f"socket,id=qmp,path={d / QMP},server=on,wait=off",
        "--monitor", "chardev=qmp",
    ]  # fmt: skip


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def _unmount(path: Path) -> None:
    if _mounted(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _start(directory: Path, top: str, top_format: str, owner_uid: int) -> int:
    export = directory / EXPORT
    _unmount(export)  # a daemon that died left its mount (ENOTCONN)
    for name in (PIDFILE, QMP):
        (directory / name).unlink(missing_ok=True)
    export.touch(mode=0o600)
    argv = export_argv(directory, top, top_format)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError as exc:
        raise FeosError(Code.FAILED_PRECONDITION, f"{QSD} is not installed") from exc
    if done.returncode != 0:
        raise FeosError(Code.INTERNAL, f"{QSD} did not export {directory.name}: "
                        f"{done.stderr.strip()}")
    pid = int((directory / PIDFILE).read_text().strip())
    os.chown(export, owner_uid, owner_uid)  # allow_other and default_permissions: the owner opens
    return pid


async def start(directory: Path, top: str, top_format: str, owner_uid: int) -> int:
    """Serve the chain at directory/export.raw; the daemon's pid."""
    return await trio.to_thread.run_sync(_start, directory, top, top_format, owner_uid)


def alive(directory: Path, pid: int) -> bool:
    """The daemon of this disk runs as `pid` (not another process that took the number)."""
    if pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].endswith(QSD.encode()) and \
        str(directory / PIDFILE).encode() in cmdline and _mounted(directory / EXPORT)


async def _ended(pid: int, within: float) -> bool:
    """The process ended within `within` (a pidfd turns readable at its exit, child or not)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with trio.move_on_after(within):
            await trio.lowlevel.wait_readable(fd)
            return True
        return False
    finally:
        os.close(fd)


async def stop(directory: Path, pid: int) -> None:
    """Flushed, closed, ended; the mount gone."""
    if alive(directory, pid):
        try:
            await _quit(directory)
        except FeosError as exc:
            log.warning("disk %s: %s did not quit through QMP (%s): ending it",
                        directory.name, QSD, exc.message)
        if not await _ended(pid, STOP_S):
            _signal(pid, signal.SIGTERM)
            if not await _ended(pid, STOP_S):
                _signal(pid, signal.SIGKILL)
                await _ended(pid, 5.0)
    await trio.to_thread.run_sync(_unmount, directory / EXPORT)


async def _quit(directory: Path) -> None:
    qmp = await connect_qmp(str(directory / QMP), within=5.0)
    try:
        with trio.fail_after(STOP_S):
            mark = qmp.events_seen()
            await qmp.execute("block-export-del", {"id": "export"})
            await qmp.wait_new_event(mark, "BLOCK_EXPORT_DELETED")
            await qmp.execute("blockdev-del", {"node-name": "disk"})  # flushes the chain
            await qmp.execute("blockdev-del", {"node-name": "file"})
            await qmp.execute("quit")
    except trio.TooSlowError:
        raise FeosError(Code.DEADLINE_EXCEEDED, f"no flush within {STOP_S:g}s") from None
    except Exception as exc:  # QmpError and the like: the fallback ends it by signal
        if isinstance(exc, FeosError):
            raise
        raise FeosError(Code.INTERNAL, str(exc)) from exc
    finally:
        qmp.close()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
