"""The ::1 relay of published TCP ports: [::1]:HOSTPORT on the node to [the pod's IPv6]:PODPORT.

The kernel does not route a packet from ::1 out of a device (IPv6 has no route_localnet), so a
DNAT of ::1 to a pod cannot work; feosd listens there itself and copies bytes both ways. The
table's nat-output leaves ::1 alone for this. UDP to ::1 is not relayed (docs/network.md).

Theory of operation. `Relays.run` holds a nursery; `sync(wanted)` closes the listeners no longer
wanted and opens the new ones (bound in the network's namespace, on a worker thread), each served
by a task in its own cancel scope: cancelling it ends its listener and every connection it took.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

import trio

from ._links import netns_entered

log = logging.getLogger(__name__)
Target = tuple[str, int]  # the pod's IPv6 address, its port
BUFFER = 65536


class Relays:
    def __init__(self, netns: str | None) -> None:
        self.netns = netns
        self._nursery: trio.Nursery | None = None
        self._open: dict[int, tuple[Target, trio.CancelScope]] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._open.clear()

    def ports(self) -> list[int]:
        return sorted(self._open)

    async def sync(self, wanted: Mapping[int, Target]) -> None:
        """Listen on [::1]:port for each of `wanted`, to its target; nothing else."""
        if self._nursery is None:
            return
        for port, (target, scope) in list(self._open.items()):
            if wanted.get(port) != target:
                scope.cancel()
                del self._open[port]
        for port, target in wanted.items():
            if port in self._open:
                continue
            try:
                sock = await trio.to_thread.run_sync(self._bind, port)
            except OSError as e:
                log.warning("the ::1 relay of port %d: %s", port, e)
                continue
            scope = trio.CancelScope()
            self._open[port] = (target, scope)
            self._nursery.start_soon(self._serve, sock, target, scope)

    def _bind(self, port: int) -> socket.socket:
        with netns_entered(self.netns):
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(("::1", port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        return sock

    def _socket(self) -> socket.socket:
        with netns_entered(self.netns):
            return socket.socket(socket.AF_INET6, socket.SOCK_STREAM)

    async def _serve(self, sock: socket.socket, target: Target, scope: trio.CancelScope) -> None:
        with scope:
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
            async with listener, trio.open_nursery() as nursery:
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._pipe, stream, target)

    async def _pipe(self, client: trio.SocketStream, target: Target) -> None:
        async with client:
            out = trio.socket.from_stdlib_socket(await trio.to_thread.run_sync(self._socket))
            try:
                await out.connect(target)
            except OSError as e:
                out.close()
                log.info("the ::1 relay to [%s]:%d: %s", *target, e)
                return
            async with trio.SocketStream(out) as pod, trio.open_nursery() as nursery:
                nursery.start_soon(_copy, client, pod, nursery.cancel_scope)
                nursery.start_soon(_copy, pod, client, nursery.cancel_scope)


async def _copy(src: trio.SocketStream, dst: trio.SocketStream, both: trio.CancelScope) -> None:
    """src to dst until src ends, then end dst's sending side (a half-close, as TCP has); an
    error of either side ends both copies."""
    try:
        while data := await src.receive_some(BUFFER):
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        both.cancel()
