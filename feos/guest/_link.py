"""The guest link's byte pump on asyncio, shared by the agent and the node's client.

It imports nothing of either end's RPC system (and nothing of the agent but _hello): the node's
client (feos.guestlink) takes Link and Pump through feos.guest's public names.

Each end's Cap'n Proto RPC system talks to one end of a socketpair; the pump copies between the
other end and the link, watching the link's direction through a Scanner so that a hello or poke
at a message boundary ends the session (the RPC system sees its stream close) instead of reaching
the RPC system as garbage. The link itself is a socket (Unix, vsock) or a character device (the
virtio-serial port), which reads EOF while the node is not connected.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket

from ._hello import Hello, Scanner

CHUNK = 65536


def _set(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Link:
    """A stream socket as the link."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    async def recv(self) -> bytes:
        return await asyncio.get_running_loop().sock_recv(self.sock, CHUNK)

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def wait_peer(self) -> None:
        """Until the other end is there to read (a socket's is, once connected)."""

    def close(self) -> None:
        self.sock.close()


class DeviceLink(Link):
    """The virtio-serial port: reads EOF and polls HUP while the node is not connected."""

    def __init__(self, fd: int) -> None:  # not super().__init__: that one takes a socket
        os.set_blocking(fd, False)
        self.fd = fd

    async def recv(self) -> bytes:
        while True:
            try:
                return os.read(self.fd, CHUNK)
            except BlockingIOError:
                await self._ready(select.POLLIN)

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                await self._ready(select.POLLOUT)

    async def wait_peer(self) -> None:
        # The port polls POLLOUT only while the host end is connected; asyncio's epoll would
        # report the HUP without end, so this polls itself, every 50 ms.
        while True:
            p = select.poll()
            p.register(self.fd, select.POLLOUT)
            events = p.poll(0)
            if events and events[0][1] & select.POLLOUT and not events[0][1] & select.POLLHUP:
                return
            await asyncio.sleep(0.05)

    async def _ready(self, event: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        add, remove = (
            (loop.add_reader, loop.remove_reader)
            if event == select.POLLIN
            else (loop.add_writer, loop.remove_writer)
        )
        add(self.fd, _set, fut)
        try:
            await fut
        finally:
            remove(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class Pump:
    """One link's pump; its Scanner lasts as long as the link's stream does."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.scanner = Scanner()
        self._events: list[tuple[str, object]] = []

    async def _next_event(self) -> tuple[str, object]:
        while not self._events:
            data = await self.link.recv()
            if not data:
                raise EOFError("the link closed")
            self._events = self.scanner.feed(data)
        return self._events.pop(0)

    async def next_line(self, kind: bytes) -> Hello:
        """Reads until a hello of that kind; what comes before it is dropped."""
        while True:
            what, value = await self._next_event()
            if what == "line" and isinstance(value, Hello) and value.kind == kind:
                return value

    async def session(
        self, rpc: socket.socket, end_on: bytes, *, first_ignored: bool
    ) -> Hello | None:
        """Pumps between the link and the RPC system's socket until the session ends.

        Returns the line of kind `end_on` that ended it (a poke for the agent, a hello for the
        node), or None when the RPC system closed its socket; raises EOFError when the link did.
        With first_ignored, such a line before the first message is taken as already answered.
        """
        rpc.setblocking(False)
        down = asyncio.ensure_future(self._down(rpc, end_on, first_ignored))
        up = asyncio.ensure_future(self._up(rpc))
        try:
            done, _ = await asyncio.wait((down, up), return_when=asyncio.FIRST_COMPLETED)
            return (down if down in done else up).result()
        finally:
            for task in (down, up):
                task.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            rpc.close()

    async def _down(self, rpc: socket.socket, end_on: bytes, first_ignored: bool) -> Hello | None:
        loop = asyncio.get_running_loop()
        seen_data = False
        while True:
            what, value = await self._next_event()
            if what == "data":
                seen_data = True
                await loop.sock_sendall(rpc, value)  # type: ignore[arg-type]
            elif isinstance(value, Hello) and value.kind == end_on:
                if seen_data or not first_ignored:
                    return value

    async def _up(self, rpc: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(rpc, CHUNK)
            if not data:
                return None
            await self.link.send(data)
