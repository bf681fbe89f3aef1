"""feos.native's userfaultfd calls against the kernel: the handshake, a registration, pages
placed by UFFDIO_COPY and UFFDIO_ZEROPAGE into missing pages (no fault needed: a copy into a
registered page fills it), EEXIST for a page that is there, a remove event decoded as the
handler reads it (a child's madvise, which waits until the event is read), and pidfd_getfd.
The handler's whole loop is in integration/test_diskd_lazy.py."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket

from feos import native

PAGE = 4096


def base_of(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def test_copy_zeropage_and_eexist() -> None:
    consts = native.uffd_constants()
    uffd = native.uffd_open()
    try:
        features, ioctls = native.uffd_api(uffd, consts["UFFD_FEATURE_EVENT_REMOVE"])
        assert features & consts["UFFD_FEATURE_EVENT_REMOVE"] and ioctls
        region = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = base_of(region)
        assert native.uffd_register(uffd, base, 8 * PAGE)
        assert native.uffd_copy(uffd, base, b"ab" * PAGE) == (2 * PAGE, 0)
        assert native.uffd_zeropage(uffd, base + 2 * PAGE, 2 * PAGE) == (2 * PAGE, 0)
        assert native.uffd_copy(uffd, base + 3 * PAGE, b"c" * 2 * PAGE) == (0, errno.EEXIST)
        assert native.uffd_copy(uffd, base + 4 * PAGE, b"d" * 4 * PAGE) == (4 * PAGE, 0)
        assert region[:2 * PAGE] == b"ab" * PAGE and region[2 * PAGE:4 * PAGE] == bytes(2 * PAGE)
        assert region[4 * PAGE:] == b"d" * 4 * PAGE
        native.uffd_wake(uffd, base, 8 * PAGE)
        region.close()
    finally:
        os.close(uffd)


def test_a_remove_event_is_decoded_and_pidfd_getfd_takes_the_fd() -> None:
    consts = native.uffd_constants()
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: its memory registered, its fd handed over, then a madvise that
        try:      # waits until its handler has read the event
            parent.close()
            region = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = base_of(region)
            uffd = native.uffd_open(os.O_CLOEXEC)
            native.uffd_api(uffd, consts["UFFD_FEATURE_EVENT_REMOVE"])
            native.uffd_register(uffd, base, 4 * PAGE)
            native.uffd_copy(uffd, base, b"x" * 4 * PAGE)
            socket.send_fds(child, [f"{base} {uffd}".encode()], [uffd])
            child.recv(1)
            region.madvise(mmap.MADV_DONTNEED, PAGE, 2 * PAGE)
            child.send(b"k")
            child.recv(1)
        finally:
            os._exit(0)
    child.close()
    try:
        message, fds, _, _ = socket.recv_fds(parent, 100, 1)
        base, number = map(int, message.split())
        uffd = fds[0]
        pidfd = os.pidfd_open(pid)
        copy = native.pidfd_getfd(pidfd, number)
        assert os.readlink(f"/proc/self/fd/{copy}") == "anon_inode:[userfaultfd]"
        assert os.fstat(copy).st_ino == os.fstat(uffd).st_ino  # the child's own, again
        os.close(copy)
        os.close(pidfd)
        parent.send(b"go")
        raw = os.read(uffd, native.uffd_msg_size())
        assert native.uffd_events(raw) == [(consts["UFFD_EVENT_REMOVE"], base + PAGE,
                                            base + 3 * PAGE)]  # fmt: skip
        assert parent.recv(1) == b"k"
        os.close(uffd)
    finally:
        parent.close()
        os.waitpid(pid, 0)
