"""The typed face of feos._native, feosd's one compiled module (built from native/build.py).

What feosd asks of the kernel beyond Python's standard library: flock, setns, the subreaper bit,
hole punching, datagrams by the batch (recvmmsg/sendmmsg), and the records' group commit (a
group's steps in one call without the GIL: a writer thread that took the GIL back after each of
a record's six system calls waited behind the Cap'n Proto thread each time). Every call's
failure becomes OSError in one place (`_check`), with errno and the call's name. Nothing else
imports feos._native; the in-guest agent never needs it (it imports nothing of this module).

Memory: the C side keeps no address Python gave it. A DatagramBatch is one block that cffi
allocates and frees with the object; its headers point only into that block (native/build.py);
an answer's bytes are copied into the block by the call that queues them, and every index and
length is checked there. The views it offers (`data`, `lengths`, `addrs`) are views of the whole
block's buffer, which holds the block alive for as long as any view of it lives.

The module is made by the install (setup.py's cffi_modules); a work tree without an install
builds it in place with `python native/build.py`. Where it is missing, `available()` is False,
the DNS server reads datagram by datagram, and the calls here raise ImportError naming the fix.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any, Literal

try:
    from feos import _native  # type: ignore[attr-defined]
except ImportError as exc:  # not built in this tree: see the docstring
    _native, _MISSING = None, str(exc)
else:
    _MISSING = ""

# native/build.py's: datagrams a batch reads (answers it sends), and a datagram's room
BATCH_MAX, SLOT = (
    (64, 65536) if _native is None else (_native.lib.FEOS_BATCH_MAX, _native.lib.FEOS_SLOT)
)
CLONE_NEWNET = 0x40000000
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


def available() -> bool:
    """Whether the compiled module is there."""
    return _native is not None


def _lib() -> Any:
    if _native is None:
        raise ImportError(
            f"feos._native is not built ({_MISSING}): install the package "
            "(pip install -e .) or build it in place with `python native/build.py`"
        )
    return _native.lib


def _check(rc: int, what: str) -> int:
    """rc, unless the call failed (a negative rc): then OSError from the call's errno."""
    if rc < 0:
        err = _native.ffi.errno
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def _failed_with(rc: int, *errnos: int) -> bool:
    """Whether the call failed with one of these errnos (an answer, not an error)."""
    return rc < 0 and _native.ffi.errno in errnos


# --- files and processes -----------------------------------------------------------------------


def flock(fd: int, *, exclusive: bool = True, wait: bool = True) -> bool:
    """flock(2) on fd; False when `wait` is off and another holder has it."""
    lib = _lib()
    op = (lib.LOCK_EX if exclusive else lib.LOCK_SH) | (0 if wait else lib.LOCK_NB)
    rc = lib.flock(fd, op)
    while wait and _failed_with(rc, errno.EINTR):  # a signal came: its handler ran, wait on
        rc = lib.flock(fd, op)
    if not wait and _failed_with(rc, *_AGAIN):
        return False
    _check(rc, "flock")
    return True


def unlock(fd: int) -> None:
    lib = _lib()
    _check(lib.flock(fd, lib.LOCK_UN), "flock(LOCK_UN)")


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace fd refers to (a network one by default)."""
    _check(_lib().setns(fd, nstype), "setns")


def set_child_subreaper(on: bool = True) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of this process's children come to it."""
    _check(_lib().feos_set_child_subreaper(int(on)), "prctl(PR_SET_CHILD_SUBREAPER)")


def is_child_subreaper() -> bool:
    return bool(_check(_lib().feos_is_child_subreaper(), "prctl(PR_GET_CHILD_SUBREAPER)"))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE): the range reads as zeros and holds no blocks."""
    lib = _lib()
    mode = lib.FALLOC_FL_PUNCH_HOLE | lib.FALLOC_FL_KEEP_SIZE
    _check(lib.feos_fallocate(fd, mode, offset, length), "fallocate(PUNCH_HOLE)")


# --- records -------------------------------------------------------------------------------


def can_commit_groups() -> bool:
    """Whether the module built has the group commit (a build older than it has not: then the
    records' writer makes the same steps in Python, until `python native/build.py` runs)."""
    return _native is not None and hasattr(_native.lib, "feos_commit_group")


def commit_group(
    dir_fd: int, changes: Sequence[tuple[str, str, bytes | None]]
) -> tuple[list[int], int]:
    """The records' group commit in one call, made without the GIL (native/build.py says each
    step): each change is (temporary name, record name, bytes), or (_, record name, None) for a
    removal, the names in the directory dir_fd. The errno of each change's failed step (0: it
    was applied) and that of the directory's sync (0: synced, or nothing to sync)."""
    lib, ffi = _lib(), _native.ffi
    n = len(changes)
    tmps, names = ffi.new("char *[]", n), ffi.new("char *[]", n)
    datas, lens = ffi.new("char *[]", n), ffi.new("int64_t[]", n)
    errs = ffi.new("int[]", n)
    held = []  # what the arrays point into, alive until the call returns
    for i, (tmp, name, data) in enumerate(changes):
        held.append(ffi.new("char[]", os.fsencode(name)))
        names[i] = held[-1]
        if data is None:
            lens[i] = -1
            continue
        held.append(ffi.new("char[]", os.fsencode(tmp)))
        tmps[i] = held[-1]
        held.append(ffi.from_buffer(data))
        datas[i] = held[-1]
        lens[i] = len(data)
    dir_error = lib.feos_commit_group(dir_fd, n, tmps, names, datas, lens, errs)
    return list(errs), int(dir_error)


# --- datagrams by the batch ------------------------------------------------------------------


class DatagramBatch:
    """recvmmsg(2) and sendmmsg(2) on one datagram socket: `read` up to `size` datagrams into
    the batch's own memory, `queue` or `reply` answers to them (copied there), `flush` them in
    one call. Datagram i of the last read is `datagram(i)` (or data[data_at + i * SLOT :
    data_at + i * SLOT + lengths[i]], for a hot loop), from IPv4 address addrs[i] (as the kernel
    wrote it; 0 for another family) and port `ports[i]`. An answer goes to the address its
    datagram came from, copied when it is queued: a later read does not redirect it.

    The batch does not own the socket: it must stay open while the batch is used."""

    def __init__(self, fd: int, size: int = BATCH_MAX) -> None:
        lib, ffi = _lib(), _native.ffi
        self.size = size
        self._block = ffi.new("struct feos_batch *")  # zeroed, freed with the last view
        _check(lib.feos_batch_init(self._block, fd, size), "batch")
        self.data = ffi.buffer(self._block)  # the whole block; its slices are bytes
        whole = memoryview(self.data).cast("B")
        self.data_at = ffi.offsetof("struct feos_batch", "data")
        self.lengths = _field(whole, ffi, "lengths", BATCH_MAX, "I")
        self.addrs = _field(whole, ffi, "addrs", BATCH_MAX, "I")
        self.ports = _field(whole, ffi, "ports", BATCH_MAX, "H")
        self._queue, self._recv, self._send = (
            lib.feos_batch_queue, lib.feos_batch_recv, lib.feos_batch_send
        )  # fmt: skip

    @property
    def got(self) -> int:
        """How many datagrams the last read got."""
        return int(self._block.got)

    @property
    def queued(self) -> int:
        return int(self._block.queued)

    def read(self) -> int:
        """Read what waits in the socket, up to a batch, without waiting; how many (0: none).
        The answers queued and not flushed yet stay queued."""
        return _check(self._recv(self._block), "recvmmsg")

    def datagram(self, i: int) -> bytes:
        if not 0 <= i < self._block.got:
            raise IndexError(f"datagram {i} of a batch of {self._block.got}")
        start = self.data_at + i * SLOT
        data: bytes = self.data[start : start + self.lengths[i]]
        return data

    def peer(self, i: int) -> tuple[str, int]:
        """The IPv4 address and port datagram i came from, as recvfrom gives them."""
        if not 0 <= i < self._block.got:
            raise IndexError(f"datagram {i} of a batch of {self._block.got}")
        return socket.inet_ntoa(struct.pack("=I", self.addrs[i])), self.ports[i]

    def queue(self, i: int, wire: bytes) -> bool:
        """Send wire to where datagram i came from, at the next flush; False if it is more
        than a datagram holds (then counted among flush's failures)."""
        rc = self._queue(self._block, i, 0, wire, len(wire))
        return rc == 0 or self._refused(rc, i)

    def reply(self, i: int, tail: bytes) -> bool:
        """Send datagram i's first 2 bytes (a DNS query's ID) and then tail, as `queue`."""
        rc = self._queue(self._block, i, 2, tail, len(tail))
        return rc == 0 or self._refused(rc, i)

    def _refused(self, rc: int, i: int) -> bool:
        if _failed_with(rc, errno.EMSGSIZE):
            return False
        _check(rc, f"queue an answer to datagram {i} of {self._block.got}")
        return True  # not reached: _check raised

    def flush(self) -> int:
        """Send what is queued; how many answers could not be sent (too long, refused by the
        kernel, or left when the socket's buffer filled: the clients retry)."""
        return int(self._send(self._block))


def _field(
    whole: memoryview, ffi: Any, name: str, count: int, fmt: Literal["H", "I"]
) -> memoryview:
    at = ffi.offsetof("struct feos_batch", name)
    return whole[at : at + count * struct.calcsize(fmt)].cast(fmt)


# -- ublk: the driver's structures and command numbers (<linux/ublk_cmd.h>) --------------------
# diskd's ublk data path would send these through io_uring; this host has no ublk_drv, so only
# the layouts and numbers are here (docs/disk.md, "ublk").

UBLK_STRUCTS = ("ublksrv_ctrl_cmd", "ublksrv_ctrl_dev_info", "ublksrv_io_desc", "ublksrv_io_cmd",
                "ublk_param_basic", "ublk_param_discard", "ublk_params")
_IOC_WRITE, _IOC_READ = 1, 2


def _ffi() -> Any:
    _lib()  # ImportError naming the fix when the module is not built
    return _native.ffi


def ublk_constants() -> dict[str, int]:
    """Every UBLK_* number the header defines that the module was built with."""
    lib = _lib()
    return {name: int(getattr(lib, name)) for name in dir(lib) if name.startswith("UBLK_")}


def ublk_layout(name: str) -> tuple[int, dict[str, int]]:
    """The size of `struct name` and each of its fields' offsets, as the compiler laid it out."""
    if name not in UBLK_STRUCTS:
        raise ValueError(f"{name!r} is not a ublk structure")
    ffi = _ffi()
    ctype = ffi.typeof(f"struct {name}")
    return ffi.sizeof(ctype), {field: ffi.offsetof(ctype, field) for field, _ in ctype.fields}


def ublk_ioctl(number: int, struct_name: str) -> int:
    """The command as newer kernels number it (UBLK_U_CMD_*, UBLK_U_IO_*): _IOWR('u', nr, T)."""
    size, _ = ublk_layout(struct_name)
    return ((_IOC_READ | _IOC_WRITE) << 30) | (size << 16) | (ord("u") << 8) | number


def ublk_ctrl_cmd(dev_id: int, *, queue_id: int = 0xFFFF, length: int = 0, addr: int = 0,
                  data: tuple[int, int] = (0, 0)) -> bytes:
    """A control command's bytes, as an io_uring SQE's cmd area carries them."""
    ffi = _ffi()
    cmd = ffi.new("struct ublksrv_ctrl_cmd *")
    cmd.dev_id, cmd.queue_id, cmd.len, cmd.addr = dev_id, queue_id, length, addr
    cmd.data[0], cmd.data[1] = data
    return bytes(ffi.buffer(cmd))


def ublk_io_desc(raw: bytes) -> tuple[int, int, int, int, int]:
    """An I/O descriptor the driver wrote: (op, flags, sectors, start sector, buffer address)."""
    ffi = _ffi()
    size = ffi.sizeof("struct ublksrv_io_desc")
    if len(raw) != size:
        raise ValueError(f"a ublksrv_io_desc is {size} bytes, not {len(raw)}")
    desc = ffi.new("struct ublksrv_io_desc *")
    ffi.memmove(desc, raw, size)
    return (desc.op_flags & 0xFF, desc.op_flags >> 8, desc.nr_sectors, desc.start_sector,
            desc.addr)


# -- userfaultfd: a restored pod's memory, page by page (diskd's lazy memory) ------------------
# The handler's calls (events read with os.read and decoded here, UFFDIO_COPY, UFFDIO_ZEROPAGE,
# UFFDIO_WAKE), the VMM's (uffd_open, uffd_api, uffd_register: for tests that play the VMM), and
# pidfd_getfd, by which a restarted diskd takes a VMM's userfaultfd back.

UFFD_MISSING_OK = (errno.EEXIST, errno.EAGAIN)
"""A copy or zeroing that stopped short for these is an answer: a page there is mapped already
(EEXIST), or the VMM's mappings changed meanwhile (EAGAIN: try the rest again)."""
UFFD_GONE = (errno.ESRCH, errno.ENOENT)
"""The faulting process's memory is gone (it exited, or unmapped the range)."""


def uffd_constants() -> dict[str, int]:
    """Every UFFD_* and UFFDIO_* number the module was built with."""
    lib = _lib()
    return {name: int(getattr(lib, name)) for name in dir(lib) if name.startswith("UFFD")}


def uffd_msg_size() -> int:
    """The bytes of one event (struct uffd_msg) as read(2) returns them."""
    return int(_ffi().sizeof("struct uffd_msg"))


def uffd_open(flags: int = os.O_CLOEXEC | os.O_NONBLOCK) -> int:
    """A new userfaultfd (the VMM's side); needs root or /dev/userfaultfd."""
    return _check(_lib().feos_uffd_open(flags), "userfaultfd")


def uffd_api(fd: int, features: int = 0) -> tuple[int, int]:
    """The UFFDIO_API handshake: (the features granted, the ioctls available)."""
    ffi = _ffi()
    got, ioctls = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    _check(_lib().feos_uffd_api(fd, features, got, ioctls), "UFFDIO_API")
    return int(got[0]), int(ioctls[0])


def uffd_register(fd: int, start: int, length: int, mode: int | None = None) -> int:
    """UFFDIO_REGISTER of [start, start + length) (missing-page mode by default): its ioctls."""
    lib, ffi = _lib(), _ffi()
    ioctls = ffi.new("uint64_t *")
    mode = lib.UFFDIO_REGISTER_MODE_MISSING if mode is None else mode
    _check(lib.feos_uffd_register(fd, start, length, mode, ioctls), "UFFDIO_REGISTER")
    return int(ioctls[0])


def uffd_copy(fd: int, dst: int, src: bytes | bytearray | memoryview, *, wake: bool = True
              ) -> tuple[int, int]:  # fmt: skip
    """UFFDIO_COPY of src to the faulting process's dst: (bytes copied, 0), or (bytes copied
    before it stopped, errno) for UFFD_MISSING_OK and UFFD_GONE; OSError for anything else.
    The GIL is released during the copy."""
    lib, ffi = _lib(), _ffi()
    done = ffi.new("int64_t *")
    mode = 0 if wake else lib.UFFDIO_COPY_MODE_DONTWAKE
    rc = lib.feos_uffd_copy(fd, dst, ffi.from_buffer(src), len(src), mode, done)
    return _partial(rc, int(done[0]), "UFFDIO_COPY")


def uffd_zeropage(fd: int, start: int, length: int, *, wake: bool = True) -> tuple[int, int]:
    """UFFDIO_ZEROPAGE of [start, start + length): as uffd_copy."""
    lib, ffi = _lib(), _ffi()
    done = ffi.new("int64_t *")
    mode = 0 if wake else lib.UFFDIO_ZEROPAGE_MODE_DONTWAKE
    rc = lib.feos_uffd_zeropage(fd, start, length, mode, done)
    return _partial(rc, int(done[0]), "UFFDIO_ZEROPAGE")


def _partial(rc: int, done: int, what: str) -> tuple[int, int]:
    if rc == 0:
        return done, 0
    err = _native.ffi.errno
    if err in UFFD_MISSING_OK or err in UFFD_GONE:
        return done, err
    raise OSError(err, f"{what}: {os.strerror(err)}")


def uffd_wake(fd: int, start: int, length: int) -> None:
    """UFFDIO_WAKE: the threads waiting on a fault in the range retry it (after a handler that
    read their fault went away without resolving it)."""
    _check(_lib().feos_uffd_wake(fd, start, length), "UFFDIO_WAKE")


def uffd_events(raw: bytes) -> list[tuple[int, int, int]]:
    """The events read from a userfaultfd, each (event, a, b): a page fault (flags, address),
    a removal or an unmap (start, end), a remap (from, to), a fork (the new fd, 0)."""
    lib, ffi = _lib(), _ffi()
    size = ffi.sizeof("struct uffd_msg")
    if len(raw) % size:
        raise ValueError(f"{len(raw)} bytes are not whole events of {size}")
    event, a, b = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    buffer = ffi.from_buffer(raw)
    found = []
    for offset in range(0, len(raw), size):
        lib.feos_uffd_decode(buffer + offset, event, a, b)
        found.append((int(event[0]), int(a[0]), int(b[0])))
    return found


def pidfd_getfd(pidfd: int, target_fd: int) -> int:
    """A duplicate of another process's fd (pidfd_getfd(2): root, or ptrace rights over it)."""
    return _check(_lib().feos_pidfd_getfd(pidfd, target_fd), "pidfd_getfd")
