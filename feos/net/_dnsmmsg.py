"""recvmmsg(2) and sendmmsg(2) on the resolver's UDP socket: a batch of datagrams a system call.

Why: most of a cached answer's CPU is its two system calls, and Python's recvfrom and sendto add
their own cost to each (a tuple and a str of the address, its parse back, the GIL let go and
taken again). One call reads up to `batch` datagrams, one call sends every answer queued for
them, each to the address its query came from, as the kernel wrote it.

The batch is feos.native's DatagramBatch (compiled against the system's headers, native/build.py):
its memory is its own, and an answer is copied into it when it is queued, so nothing queued
depends on a Python object living until the flush. What this module adds is the DNS side's: the
sources' text, kept (`source`), and the batch as a list (`receive`).

`open_batcher(sock)` returns None where it cannot work (the module not built, not an IPv4
datagram socket): the server then loops on recvfrom and sendto.
"""

from __future__ import annotations

import socket
import struct

from feos import native

SLOT = native.SLOT
_SOURCES_KEPT = 4096


def load() -> bool:
    """Whether batching works here (the compiled module is there)."""
    return native.available()


def open_batcher(sock: socket.socket, batch: int = native.BATCH_MAX) -> Batcher | None:
    if sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM or not load():
        return None
    return Batcher(sock, batch)


class Batcher(native.DatagramBatch):
    """A DatagramBatch on the resolver's socket (which must outlive it), with its sources'
    text kept: a pod sends many queries. The attributes the hot loop reads are named in
    DatagramBatch's docstring (_dnsfast.answer_batch)."""

    def __init__(self, sock: socket.socket, batch: int) -> None:
        super().__init__(sock.fileno(), batch)
        self.sources: dict[int, str] = {}  # addrs' text, kept: `source`

    def receive(self) -> list[tuple[bytes, str]]:
        """`read`, as a list of each datagram and its source's address; its index in the list is
        the one to `queue` its answer at. Empty once nothing waits."""
        return [(self.datagram(i), self.source(self.addrs[i])) for i in range(self.read())]

    def source(self, addr: int) -> str:
        """An address as `addrs` holds it, as text (kept: a pod sends many queries)."""
        text = self.sources.get(addr)
        if text is None:
            text = socket.inet_ntoa(struct.pack("=I", addr))
            if len(self.sources) >= _SOURCES_KEPT:
                self.sources.clear()
            self.sources[addr] = text
        return text
