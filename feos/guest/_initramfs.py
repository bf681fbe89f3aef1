"""The initramfs's files, removed once the agent is up (what switch_root would have done first).

/init moves the root onto / and chroots there, as switch_root does but for its first step, the
removal of every file of the initramfs: 0.2 s of the guest's start under TCG, for memory nothing
needs at once (busybox, the modules: about 5 MB). /init leaves the initramfs's / open as a file
descriptor and names it in FEOS_INITRAMFS_FD; the agent removes what is under it once its first
session is attached, on a thread of its own under SCHED_IDLE (it takes only the vCPU's idle
time: the pod's bring-up goes first), without crossing into other filesystems and without
following symbolic links.
"""

from __future__ import annotations

import os
import stat
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

ENV = "FEOS_INITRAMFS_FD"


def take(environ: dict[str, str] | None = None) -> int | None:
    """The descriptor /init left, out of the environment and closed on exec (no child sees it)."""
    env = os.environ if environ is None else environ
    text = env.pop(ENV, "")
    if not text.isdigit():
        return None
    fd = int(text)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return None
        os.set_inheritable(fd, False)
    except OSError:
        return None
    return fd


def remove_under(dirfd: int) -> tuple[int, int]:
    """Removes everything under the directory dirfd on its filesystem: (entries removed, kept).

    A directory of another filesystem (a mount point) is kept with all it holds; so is an entry
    that cannot be removed. The descriptor itself stays open (the caller's to close).
    """
    dev = os.fstat(dirfd).st_dev
    removed = kept = 0
    for name in os.listdir(dirfd):
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dirfd)
                removed += 1
                continue
            if st.st_dev != dev:
                kept += 1
                continue
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
            try:
                r, k = remove_under(sub)
            finally:
                os.close(sub)
            removed, kept = removed + r, kept + k
            if k:
                kept += 1
                continue
            os.rmdir(name, dir_fd=dirfd)
            removed += 1
        except OSError:
            kept += 1
    return removed, kept


def release(fd: int, log: Callable[[str], object] | None = None) -> threading.Thread:
    """Removes the initramfs's files on a daemon thread, then closes fd; says what it did."""

    def run() -> None:
        try:  # this thread alone: it runs only when nothing else in the guest wants the vCPU
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
        started = time.monotonic()
        try:
            removed, kept = remove_under(fd)
        finally:
            os.close(fd)
        if log is not None:
            took = time.monotonic() - started
            log(f"the initramfs's files removed: {removed}, kept {kept} ({took:.3f} s)")

    thread = threading.Thread(target=run, name="initramfs", daemon=True)
    thread.start()
    return thread
