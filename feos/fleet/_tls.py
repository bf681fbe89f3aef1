"""TLS over a socket on trio without trio.SSLStream: a write goes out at once, in the writer's turn.

Theory of operation: `TLSSocket` owns a non-blocking socket and an ssl.SSLObject over two
MemoryBIOs. `write(data)` encrypts at once (one record per 16 KiB) and sends what the socket
takes there and then; what it does not take waits in `pending` for `flush()`, which waits for
the socket to be writable. `receive()` gives what the peer sent, decrypted: it reads the socket
without a trip through trio's scheduler while bytes are there, and parks on `wait_readable` when
there are none, or when the last read emptied the socket (a node connection's single call: its
read after the answer would fail, for a syscall and an exception).

trio.SSLStream costs a node connection a task hop per answer (its writer task), and per call
several checkpoints and its conflict detectors: a call's own CPU in Python is small beside them.
One task reads (`receive`), and one task waits for writability (`flush`); `write` may be called
from any task of the run, since it never waits. A receive that finds bytes at once yields to the
scheduler every YIELD_EVERY times, so that a peer that keeps sending does not starve the run.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import trio

RECEIVE_SIZE = 256 * 1024
CHUNK = 32 * 1024  # plaintext per receive: the answers to the first calls go out sooner
YIELD_EVERY = 16


class TLSSocket:
    """One TLS connection over `sock` (made non-blocking here); `handshake()` first."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool = False,
                 server_hostname: str | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = ctx.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                       server_hostname=server_hostname)
        self.pending = bytearray()  # encrypted bytes the socket has not taken yet
        self._unyielded = 0
        self._drained = False  # the last recv took less than it asked: the socket had no more
        self.closed = False

    @classmethod
    def from_trio(cls, stream: trio.SocketStream, ctx: ssl.SSLContext,
                  **kwargs: Any) -> TLSSocket:
        """Over the socket of a trio SocketStream (open_tcp_stream's, a listener's), which
        gives its socket up."""
        fd = stream.socket.detach()
        return cls(socket.socket(fileno=fd), ctx, **kwargs)

    def selected_alpn_protocol(self) -> str | None:
        return self.ssl_object.selected_alpn_protocol()

    async def handshake(self) -> None:
        while True:
            try:
                self.ssl_object.do_handshake()
            except ssl.SSLWantReadError:
                self._take_outgoing()
                await self.flush()
                await self._fill()
                continue
            self._take_outgoing()
            await self.flush()
            return

    # -- receiving -----------------------------------------------------------------------------

    async def receive(self) -> bytes:
        """What the peer sent next; b"" at its close_notify. BrokenResourceError when the
        socket ends without one (or fails)."""
        while True:
            data = self._decrypted()
            if data is None:
                return b""
            if data:
                return data
            await self._fill()

    def _decrypted(self) -> bytes | None:
        """The plaintext in hand (b"" if none); None at the peer's close_notify."""
        parts: list[bytes] = []
        size = 0
        try:
            # read again only while bytes are in hand: a read without them raises WantRead
            while size < CHUNK and (not parts or self._incoming.pending
                                    or self.ssl_object.pending()):
                part = self.ssl_object.read(CHUNK)
                if not part:  # the peer's close_notify
                    return b"".join(parts) if parts else None
                parts.append(part)
                size += len(part)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            if not parts:
                return None
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS: {exc}") from exc
        if self._outgoing.pending:  # a key update's answer
            self._take_outgoing()
            self._send_pending()
        return b"".join(parts)

    async def _fill(self) -> None:
        """The socket's next bytes into the SSLObject."""
        if self._drained:  # a recv now would most likely fail: wait for the socket first
            self._unyielded = 0
            await trio.lowlevel.wait_readable(self.sock)
        while True:
            try:
                raw = self.sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                self._unyielded = 0
                await trio.lowlevel.wait_readable(self.sock)  # ClosedResourceError at close()
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"the socket failed: {exc}") from exc
            break
        if not raw:
            raise trio.BrokenResourceError("the peer closed the socket without close_notify")
        self._drained = len(raw) < RECEIVE_SIZE
        self._incoming.write(raw)
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    # -- sending -------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Encrypt `data` and send what the socket takes now; the rest waits in `pending`."""
        if self.closed:
            raise trio.ClosedResourceError("the TLS socket is closed")
        try:
            self.ssl_object.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS: {exc}") from exc
        self._take_outgoing()
        self._send_pending()

    async def flush(self) -> None:
        """Until the socket has taken every byte written."""
        while self.pending:
            await trio.lowlevel.wait_writable(self.sock)
            self._send_pending()

    def _take_outgoing(self) -> None:
        self.pending += self._outgoing.read()

    def _send_pending(self) -> None:
        if not self.pending:
            return
        try:
            sent = self.sock.send(self.pending)
        except BlockingIOError:
            return
        except OSError as exc:
            raise trio.BrokenResourceError(f"the socket failed: {exc}") from exc
        del self.pending[:sent]

    async def aclose(self) -> None:
        """close_notify, sent if the socket takes it at once, and the socket closed."""
        if not self.closed:
            try:
                self.ssl_object.unwrap()
            except ssl.SSLError:
                pass  # SSLWantReadError: the peer's close_notify is not awaited
            try:
                self._take_outgoing()
                self._send_pending()
            except trio.BrokenResourceError:
                pass
        self.close()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """The socket closed at once; a task waiting on it gets ClosedResourceError."""
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
