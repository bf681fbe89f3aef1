"""recvmmsg(2) and sendmmsg(2) on the resolver's UDP socket: a batch of datagrams a system call.

Why: most of a cached answer's CPU is its two system calls, and Python's recvfrom and sendto add
their own cost to each (a tuple and a str of the address, its parse back, the GIL let go and
taken again). Through cffi's ABI mode (libc's own functions: nothing is compiled) one call reads up
to `batch` datagrams into buffers made once, and one call sends every answer queued for them:
the answers are copied into slots of their own and sent to the address each query came from, as
the kernel wrote it. The buffers are read and written through memoryviews rather than cffi's
attribute access, which costs more than the calls it saves.

`open_batcher(sock)` returns None where it cannot work (no cffi, no recvmmsg in libc, not an
LP64 system, not an IPv4 socket): the server then loops on recvfrom and sendto.
"""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any

_CDEF = """
struct iovec { void *iov_base; size_t iov_len; };
struct msghdr {
    void *msg_name; unsigned int msg_namelen; struct iovec *msg_iov; size_t msg_iovlen;
    void *msg_control; size_t msg_controllen; int msg_flags;
};
struct mmsghdr { struct msghdr msg_hdr; unsigned int msg_len; };
int recvmmsg(int sockfd, struct mmsghdr *msgvec, unsigned int vlen, int flags, void *timeout);
int sendmmsg(int sockfd, struct mmsghdr *msgvec, unsigned int vlen, int flags);
"""
MSG_DONTWAIT = 0x40
SLOT = 65536  # a datagram's room: the most UDP carries, so nothing is ever cut
NAME = 16  # sizeof(struct sockaddr_in)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)

_ffi: Any = None
_lib: Any = None


def load() -> bool:
    """Make cffi's view of libc, once (a third of a second of CPU: parse the declarations off
    trio's thread); whether batching works here."""
    global _ffi, _lib
    if _lib is None:
        try:
            from cffi import FFI  # type: ignore[import-untyped]

            ffi = FFI()
            ffi.cdef(_CDEF)
            lib = ffi.dlopen(None)
            lib.recvmmsg, lib.sendmmsg  # noqa: B018  (missing symbols raise here, not later)
        except (ImportError, OSError, AttributeError):
            return False
        if ffi.sizeof("void *") != 8 or ffi.sizeof("size_t") != 8:
            return False  # the views below read pointers and lengths as 8-byte words
        _ffi, _lib = ffi, lib
    return True


def open_batcher(sock: socket.socket, batch: int = 64) -> Batcher | None:
    if sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM or not load():
        return None
    return Batcher(sock, batch)


class Batcher:
    """Datagrams in by the batch (`read`/`receive`), answers out by the batch (`queue`,
    `queue_reply`, `flush`).

    Each answer goes out as two iovecs: an answer of the cache's (`queue_reply`) is the 2-byte
    ID of its query, where recvmmsg put it, and the kept bytes after the ID, where they are:
    nothing is copied or joined in Python. Any other answer (`queue`) is copied to a slot of its
    own. The attributes named in `read`'s docstring are the hot loop's (_dnsfast.answer_batch)."""

    def __init__(self, sock: socket.socket, batch: int) -> None:
        ffi = _ffi
        self.size = batch
        self._fd = sock.fileno()
        self._keep: list[Any] = []  # cffi's memory lives as long as its cdata objects
        self._rmsgs, rbufs = self._new("struct mmsghdr[]", batch), self._new("char[]", batch * SLOT)
        self._smsgs, sbufs = self._new("struct mmsghdr[]", batch), self._new("char[]", batch * SLOT)
        riov, siov = self._new("struct iovec[]", batch), self._new("struct iovec[]", 2 * batch)
        names = self._new("char[]", batch * NAME)
        self._names = names
        for i in range(batch):
            riov[i].iov_base, riov[i].iov_len = rbufs + i * SLOT, SLOT
            self._rmsgs[i].msg_hdr.msg_iov, self._rmsgs[i].msg_hdr.msg_iovlen = riov + i, 1
            self._rmsgs[i].msg_hdr.msg_name = names + i * NAME
            self._rmsgs[i].msg_hdr.msg_namelen = NAME
            self._smsgs[i].msg_hdr.msg_iov, self._smsgs[i].msg_hdr.msg_iovlen = siov + 2 * i, 2
            self._smsgs[i].msg_hdr.msg_namelen = NAME
        self.data = ffi.buffer(rbufs)  # datagram i at i * SLOT: slices of it are bytes
        self._out = memoryview(ffi.buffer(sbufs)).cast("B")
        self.addrs = memoryview(ffi.buffer(names)).cast("I")  # datagram i's sin_addr: 4 * i + 1
        size = ffi.sizeof("struct mmsghdr")  # 64 on LP64, which load() checked
        self.len_step = size // 4  # datagram i's length: lengths[len_at + i * len_step]
        self.len_at = ffi.offsetof("struct mmsghdr", "msg_len") // 4
        self.lengths = memoryview(ffi.buffer(self._rmsgs)).cast("I")
        # What queue_reply writes, for the hot loop to write itself (_dnsfast.answer_batch): the
        # k-th answer queued (k = queued) to datagram i is msg_name (word k * step of headers)
        # = name_ptrs[i] and the iovecs (words 4k to 4k + 3 of iov) = rptrs[i], 2, where, length.
        self.step = size // 8  # mmsghdrs in 8-byte words
        self.headers = memoryview(ffi.buffer(self._smsgs)).cast("Q")
        self.iov = memoryview(ffi.buffer(siov)).cast("Q")
        self.name_ptrs = [_address(names + i * NAME) for i in range(batch)]
        self.rptrs = [_address(rbufs + i * SLOT) for i in range(batch)]
        self._sptrs = [_address(sbufs + i * SLOT) for i in range(batch)]
        self.sources: dict[int, str] = {}  # addrs' text, kept: `source`
        self.queued = self._unsendable = 0

    def _new(self, ctype: str, n: int) -> Any:
        cdata = _ffi.new(ctype, n)
        self._keep.append(cdata)
        return cdata

    def read(self) -> int:
        """Read what waits in the socket, up to a batch; how many datagrams (0: none waits).
        Datagram i is data[i * SLOT : i * SLOT + lengths[len_at + i * len_step]], from the
        address addrs[4 * i + 1] (as the kernel wrote it; `source(addr)` as text)."""
        for _ in range(self.size):
            got: int = _lib.recvmmsg(self._fd, self._rmsgs, self.size, MSG_DONTWAIT, _ffi.NULL)
            if got >= 0:
                return got
            if _ffi.errno in _AGAIN:
                return 0
            # else an ICMP error queued on the socket: nothing to answer, read on
        return 0

    def receive(self) -> list[tuple[bytes, str]]:
        """`read`, as a list of each datagram and its source's address; its index in the list is
        the one to `queue` its answer at. Empty once nothing waits."""
        return [(self.datagram(i), self.source(self.addrs[4 * i + 1])) for i in range(self.read())]

    def datagram(self, i: int) -> bytes:
        start = i * SLOT
        data: bytes = self.data[start : start + self.lengths[self.len_at + i * self.len_step]]
        return data

    def source(self, addr: int) -> str:
        """An address as `addrs` holds it, as text (kept: a pod sends many queries)."""
        text = self.sources.get(addr)
        if text is None:
            text = socket.inet_ntoa(struct.pack("=I", addr))
            if len(self.sources) >= 4096:
                self.sources.clear()
            self.sources[addr] = text
        return text

    def peer(self, i: int) -> tuple[str, int]:
        """The address datagram i of the last batch came from, as recvfrom gives it."""
        name = _ffi.buffer(self._names + i * NAME, NAME)[:]
        return socket.inet_ntoa(name[4:8]), int.from_bytes(name[2:4], "big")

    def queue(self, i: int, wire: bytes) -> None:
        """Send wire to where datagram i of the last batch came from, at the next flush."""
        k = self.queued
        if len(wire) > SLOT:
            self._unsendable += 1  # more than UDP carries: nothing a UDP answer is fitted to
            return
        self._out[k * SLOT : k * SLOT + len(wire)] = wire
        iov = self.iov
        iov[4 * k], iov[4 * k + 1], iov[4 * k + 3] = self._sptrs[k], len(wire), 0
        self.headers[k * self.step] = self.name_ptrs[i]  # msg_name, the header's first word
        self.queued = k + 1

    def queue_reply(self, i: int, pointer: int, length: int) -> None:
        """Send datagram i's first 2 bytes (its ID) and `length` bytes at `pointer` back to where
        it came from, at the next flush. The caller keeps those bytes alive until then."""
        k = self.queued
        iov = self.iov
        iov[4 * k], iov[4 * k + 1] = self.rptrs[i], 2
        iov[4 * k + 2], iov[4 * k + 3] = pointer, length
        self.headers[k * self.step] = self.name_ptrs[i]
        self.queued = k + 1

    def flush(self) -> int:
        """Send what is queued; how many could not be sent (a full buffer, a refusal)."""
        sent, queued, failed = 0, self.queued, self._unsendable
        self.queued = self._unsendable = 0
        while sent < queued:
            got = _lib.sendmmsg(self._fd, self._smsgs + sent, queued - sent, MSG_DONTWAIT)
            if got > 0:
                sent += got
            elif got == 0 or _ffi.errno in _AGAIN:
                return failed + queued - sent  # the buffer is full: the clients retry
            else:
                failed, sent = failed + 1, sent + 1  # this one refused: the rest go on
        return failed


def pin(data: bytes) -> tuple[int, Any]:
    """The address of a bytes object's contents, for `queue_reply`, and the cdata that keeps it
    (CPython never moves an object; the bytes live as long as the cdata)."""
    cdata = _ffi.from_buffer(data)
    return _address(cdata), cdata


def _address(cdata: Any) -> int:
    return int(_ffi.cast("uintptr_t", cdata))
