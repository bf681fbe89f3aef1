"""The node's end of the guest link: whole messages only, and a session held across a suspend.

The framing (where a message or a line ends) is the agent's pure one, feos.guest.Frames: this
module adds the socket and the hand-over between two VMMs' connections.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

from feos.guest import CHUNK, Frames, Link

PARK_POLL_S = 0.002


def _unread(sock: socket.socket) -> int:
    """Bytes this end sent that the peer (QEMU) has not read yet (SIOCOUTQ)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int(struct.unpack("i", out)[0])


class SwapLink(Link):
    """The node's end of the link: it sends whole messages only, and can hold a session
    across the VMM's restart (a suspend, then a resume).

    `park` stops sending at a message boundary and waits until QEMU has read every byte sent
    (which QEMU reads only into the guest's buffers: then it is in the guest's memory, and in
    the snapshot). While parked, the end of the old connection (QEMU quit) is not the end of
    the stream: reads wait for `rebind` with the resumed VMM's connection, and go on there once
    the old one is read to its end, so the guest's bytes arrive in order. `unpark` sends again;
    on a parked link whose VMM is gone and that was not rebound, it ends the stream.
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._frames = Frames()
        self._open = asyncio.Event()
        self._open.set()
        self._sending = False
        self._parked = False
        self._next: asyncio.Future[socket.socket | None] | None = None

    @property
    def parked(self) -> bool:
        return self._parked

    async def send(self, data: bytes) -> None:
        whole = self._frames.feed(data)
        await self._open.wait()
        if whole:
            self._sending = True
            try:
                await asyncio.get_running_loop().sock_sendall(self.sock, whole)
            finally:
                self._sending = False

    async def recv(self) -> bytes:
        while True:
            sock = self.sock
            try:
                data = await asyncio.get_running_loop().sock_recv(sock, CHUNK)
            except OSError:
                if not self._parked:
                    raise
                data = b""
            if data or not self._parked:
                return data
            if self._next is None:
                self._next = asyncio.get_running_loop().create_future()
            waiting = self._next
            new = await waiting
            if self._next is waiting:
                self._next = None
            if new is None:
                return b""
            sock.close()
            self.sock = new

    async def park(self, within: float) -> bool:
        """Hold the stream at a boundary until the peer read all of it; False (and sending
        again) if it did not within `within` seconds."""
        self._open.clear()
        if self._next is not None and self._next.done() and self._next.result() is None:
            self._next = None  # an unpark's end of a stream that was never read
        try:
            async with asyncio.timeout(within):
                # No event says that QEMU has read: SIOCOUTQ is polled (a suspend does it once).
                while self._sending or _unread(self.sock) > 0:  # noqa: ASYNC110
                    await asyncio.sleep(PARK_POLL_S)
        except (TimeoutError, OSError):
            self._open.set()
            return False
        self._parked = True
        return True

    def rebind(self, sock: socket.socket) -> None:
        """The resumed VMM's connection: the stream goes on there."""
        sock.setblocking(False)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        if self._next.done():  # an earlier rebind not taken yet (its VMM never ran)
            old = self._next.result()
            if old is not None:
                old.close()
            self._next = asyncio.get_running_loop().create_future()
        self._next.set_result(sock)

    def unpark(self) -> None:
        self._parked = False
        self._open.set()
        waiting = self._next
        if waiting is not None and not waiting.done():  # a read past the old VMM's end
            self._next = None
            waiting.set_result(None)  # the stream ends there
        # A rebind's connection (done) is the read's to take up, or close()'s.

    def close(self) -> None:
        if self._next is not None and self._next.done() and self._next.result() is not None:
            self._next.result().close()  # type: ignore[union-attr]
        super().close()
