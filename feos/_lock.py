"""The one feosd per node: an exclusive flock on <state-dir>/feosd.lock, with feosd's pid in it.

While another process holds it, feosd says so once and tries again every second, for as long as it
takes: a feosd that stops (a rollout's old one suspending its pods) ends in its own time, and an
exit would only meet systemd's start limit. The file is close-on-exec: a self-upgrade's exec takes
the lock again, and nothing feosd runs holds it. The flock is feos.native's (the compiled module).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from feos import native

log = logging.getLogger(__name__)


def _try(fd: int) -> bool:
    return native.flock(fd, wait=False)


def holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


async def take_lock(path: Path, *, retry: float = 1.0, who: str = "feosd") -> int:
    """Hold the lock (the fd returned) and write our pid into it; `who` names the holder's kind
    in the log (diskd holds <state>/disk/diskd.lock alike)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    said = False
    while not _try(fd):
        if not said:
            log.warning(
                "another %s (pid %s) holds %s: waiting for it, trying every %gs",
                who,
                holder(path),
                path,
                retry,
            )
            said = True
        await trio.sleep(retry)
    if said:
        log.warning("took %s", path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def held(path: Path) -> bool:
    """Some process holds the lock at path (diskd --stop-after-lock asks of feosd's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not _try(fd)  # taken: nobody held it (closing the fd lets it go again)
    finally:
        os.close(fd)
