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
    """Datagrams in by the batch (`receive`), answers out by the batch (`queue`, `flush`)."""

    def __init__(self, sock: socket.socket, batch: int) -> None:
        ffi = _ffi
        self._fd = sock.fileno()
        self._n = batch
        self._keep: list[Any] = []  # cffi's memory lives as long as its cdata objects
        self._rmsgs, self._rview, rbufs = self._vectors(batch)
        self._smsgs, self._sview, sbufs = self._vectors(batch)
        self._names = self._new("char[]", batch * NAME)
        self._data = ffi.buffer(rbufs)
        self._out = memoryview(ffi.buffer(sbufs)).cast("B")
        self._addrs = memoryview(ffi.buffer(self._names)).cast("I")  # sin_addr at index 1
        size = ffi.sizeof("struct mmsghdr")  # 64 on LP64, which load() checked
        self._step = size // 8  # mmsghdrs in 8-byte words
        self._len_at = ffi.offsetof("struct mmsghdr", "msg_len") // 4
        self._len_step = size // 4
        self._lengths = memoryview(ffi.buffer(self._rmsgs)).cast("I")
        self._headers = memoryview(ffi.buffer(self._smsgs)).cast("Q")
        self._name_ptrs = [int(ffi.cast("uintptr_t", self._names + i * NAME)) for i in range(batch)]
        self._sources: dict[int, str] = {}
        self._queued = self._unsendable = 0
        for i in range(batch):
            self._rmsgs[i].msg_hdr.msg_name = self._names + i * NAME
            self._rmsgs[i].msg_hdr.msg_namelen = NAME
            self._smsgs[i].msg_hdr.msg_namelen = NAME

    def _new(self, ctype: str, n: int) -> Any:
        cdata = _ffi.new(ctype, n)
        self._keep.append(cdata)
        return cdata

    def _vectors(self, n: int) -> tuple[Any, memoryview, Any]:
        """n mmsghdrs, each with one iovec on a slot of its own; a view of the headers in words."""
        msgs = self._new("struct mmsghdr[]", n)
        iov = self._new("struct iovec[]", n)
        bufs = self._new("char[]", n * SLOT)
        for i in range(n):
            iov[i].iov_base = bufs + i * SLOT
            iov[i].iov_len = SLOT
            msgs[i].msg_hdr.msg_iov = iov + i
            msgs[i].msg_hdr.msg_iovlen = 1
        return msgs, memoryview(_ffi.buffer(iov)).cast("Q"), bufs

    def receive(self) -> list[tuple[bytes, str]]:
        """What waits in the socket, up to a batch: each datagram and its source's address; its
        index in the list is the one to `queue` its answer at. Empty once nothing waits."""
        for _ in range(self._n):
            got = _lib.recvmmsg(self._fd, self._rmsgs, self._n, MSG_DONTWAIT, _ffi.NULL)
            if got >= 0:
                break
            if _ffi.errno in _AGAIN:
                return []
            # else an ICMP error queued on the socket: nothing to answer, read on
        else:
            return []
        lengths, at, step = self._lengths, self._len_at, self._len_step
        addrs, sources, data = self._addrs, self._sources, self._data
        out = []
        for i in range(got):
            addr = addrs[i * 4 + 1]
            source = sources.get(addr)
            if source is None:
                source = self._source(addr)
            start = i * SLOT
            out.append((data[start : start + lengths[at + i * step]], source))
        return out

    def _source(self, addr: int) -> str:
        text = socket.inet_ntoa(struct.pack("=I", addr))
        if len(self._sources) >= 4096:
            self._sources.clear()
        self._sources[addr] = text
        return text

    def peer(self, i: int) -> tuple[str, int]:
        """The address datagram i of the last batch came from, as recvfrom gives it."""
        name = _ffi.buffer(self._names + i * NAME, NAME)[:]
        return socket.inet_ntoa(name[4:8]), int.from_bytes(name[2:4], "big")

    def queue(self, i: int, wire: bytes) -> None:
        """Send wire to where datagram i of the last batch came from, at the next flush."""
        k = self._queued
        if len(wire) > SLOT:
            self._unsendable += 1  # more than UDP carries: nothing a UDP answer is fitted to
            return
        self._out[k * SLOT : k * SLOT + len(wire)] = wire
        self._sview[2 * k + 1] = len(wire)  # the iovec's length
        self._headers[k * self._step] = self._name_ptrs[i]  # msg_name, the header's first word
        self._queued = k + 1

    def flush(self) -> int:
        """Send what is queued; how many could not be sent (a full buffer, a refusal)."""
        sent, queued, failed = 0, self._queued, self._unsendable
        self._queued = self._unsendable = 0
        while sent < queued:
            got = _lib.sendmmsg(self._fd, self._smsgs + sent, queued - sent, MSG_DONTWAIT)
            if got > 0:
                sent += got
            elif got == 0 or _ffi.errno in _AGAIN:
                return failed + queued - sent  # the buffer is full: the clients retry
            else:
                failed, sent = failed + 1, sent + 1  # this one refused: the rest go on
        return failed
