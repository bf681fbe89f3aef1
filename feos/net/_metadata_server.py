"""The node's metadata service for pods under QEMU (Firecracker answers MMDS in its own device).

One listening socket per pod, bound to the pod's TAP (SO_BINDTOIFINDEX) at 169.254.169.254:80:
the pod is known by the TAP its connection came in on, never by an address it claims, and a
connection on any other link finds no socket. The address is local only for packets that come
in on a pod's TAP (the policy rule and table that feos.net._links sets up), so the node never
holds it; the socket is IP_TRANSPARENT so that the kernel lets it bind, accept and answer from
an address that is not one of the node's. The protocol is feos.net._mmds, pure, over HTTP/1.1
that feos.net._mmds_http reads with h11; this module only moves bytes. A connection is served
until the guest closes it, is idle for 10 s, has asked 100 requests, or sends one that does not
parse (answered 400, 431, 413, 501 or 505, then closed); no request ends the server.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

from ._links import netns_entered
from ._mmds import BadRequest, MmdsStore, Request, bad_request_response
from ._mmds_http import NEED_MORE, HttpSession
from ._options import METADATA4

log = logging.getLogger(__name__)

IP_TRANSPARENT = 19
SO_BINDTOIFINDEX = 62  # SO_BINDTODEVICE by index: the very TAP whose index we read
IDLE_TIMEOUT = 10.0
MAX_REQUESTS_PER_CONNECTION = 100
MAX_CONNECTIONS_PER_POD = 16


def tap_index(tap: str, netns: str | None = None) -> int:
    """The TAP's ifindex now, 0 if it is gone (blocking: a worker thread enters `netns`)."""
    with netns_entered(netns):
        try:
            return socket.if_nametoindex(tap)
        except OSError:
            return 0


def open_listener(tap: str, port: int = 80, netns: str | None = None) -> tuple[
    socket.socket, int
]:
    """A TCP socket at 169.254.169.254:port that only `tap`'s traffic reaches, and the ifindex
    it is bound to (blocking: run it on a worker thread, which enters `netns`)."""
    with netns_entered(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        index = tap_index(tap)
    try:
        if not index:
            raise OSError(19, f"no device {tap}")
        s.setsockopt(socket.SOL_SOCKET, SO_BINDTOIFINDEX, index)
        s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((str(METADATA4), port))
        s.listen(64)
        s.setblocking(False)
    except OSError as e:
        s.close()
        raise FeosError(Code.UNAVAILABLE, f"the metadata service on {tap}: {e}") from None
    return s, index


@attrs.define
class _Pod:
    store: MmdsStore
    scope: trio.CancelScope
    listener: trio.socket.SocketType
    slots: trio.Semaphore
    ifindex: int  # SO_BINDTODEVICE holds the index: a TAP made anew needs a new socket


class MetadataServer:
    """Serves each registered pod its own metadata on its own TAP."""

    def __init__(self, *, netns: str | None = None, port: int = 80,
                 clock: Callable[[], float] = time.monotonic,
                 random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        self.netns = netns
        self.port = port
        self.clock = clock
        self.random_bytes = random_bytes
        self._pods: dict[str, _Pod] = {}
        self._nursery: trio.Nursery | None = None
        # One add at a time: two for a TAP at once (a bring-up that a restart cut off, and the
        # start's pass over the running pods) would both bind, and the second fail EADDRINUSE.
        self._adding = trio.Lock()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; pods are added with add_pod once this has started."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for pod in self._pods.values():
                pod.listener.close()
            self._pods.clear()

    async def add_pod(self, tap: str, data: dict[str, Any]) -> None:
        """Serve `data` on `tap` (call it after every make_tap); a pod served already gets the
        new data, and a new socket if its TAP was made anew, and keeps its tokens."""
        if self._nursery is None:
            raise FeosError(Code.UNAVAILABLE, "the metadata service is not running")
        async with self._adding:
            await self._add_pod(tap, data)

    async def _add_pod(self, tap: str, data: dict[str, Any]) -> None:
        assert self._nursery is not None
        old = self._pods.get(tap)
        if old is not None:
            old.store.data = data
            if await trio.to_thread.run_sync(tap_index, tap, self.netns) == old.ifindex:
                return
            self.remove_pod(tap)
        raw, index = await trio.to_thread.run_sync(open_listener, tap, self.port, self.netns)
        listener = trio.socket.from_stdlib_socket(raw)
        store = old.store if old is not None else MmdsStore(data, self.random_bytes)
        pod = _Pod(store, trio.CancelScope(), listener, trio.Semaphore(MAX_CONNECTIONS_PER_POD),
                   index)
        self._pods[tap] = pod
        self._nursery.start_soon(self._accept, tap, pod)

    def remove_pod(self, tap: str) -> None:
        """Stop serving `tap` (its TAP is going away); connections in flight end."""
        pod = self._pods.pop(tap, None)
        if pod is not None:
            pod.scope.cancel()
            pod.listener.close()

    def serves(self, tap: str) -> bool:
        return tap in self._pods

    async def _accept(self, tap: str, pod: _Pod) -> None:
        with pod.scope:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await pod.listener.accept()
                    except OSError as e:
                        log.warning("metadata service on %s: accept: %s", tap, e)
                        await trio.sleep(0.1)
                        continue
                    if pod.slots.value == 0:
                        conn.close()  # a guest that opens more than its share waits for none
                        continue
                    nursery.start_soon(self._connection, pod, conn)

    async def _connection(self, pod: _Pod, conn: trio.socket.SocketType) -> None:
        async with pod.slots, trio.SocketStream(conn) as stream:
            try:
                await self._requests(pod.store, stream)
            except trio.BrokenResourceError:
                pass  # the guest went away: nothing to answer

    async def _requests(self, store: MmdsStore, conn: trio.SocketStream) -> None:
        session = HttpSession()
        for _ in range(MAX_REQUESTS_PER_CONNECTION):
            got = session.next_request()
            while got is NEED_MORE:
                with trio.move_on_after(IDLE_TIMEOUT):
                    session.receive(await conn.receive_some(65536))
                    got = session.next_request()
                    continue
                return  # idle too long
            if isinstance(got, Request):
                answer = store.respond(got, self.clock())
            elif isinstance(got, BadRequest):
                answer = bad_request_response(got)
            else:
                return  # CLOSED: the guest is done
            await conn.send_all(session.respond(answer))
            if session.closing:
                return
