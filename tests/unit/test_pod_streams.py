"""The relay of `pod logs --follow` and exec, with real pycapnp over socketpairs: a caller that
goes ends its pumps, and the guest's side of the streams hears it."""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

import capnp  # type: ignore[import-untyped]

from feos import _schema
from feos.pods._streams import Relay, open_logs
from feos.rpc._bridge import CapnpThread, capnp_thread
from feos.rpc._server import Cap, on_rpc_thread, serve

GUEST = _schema.load("guest")


class FollowedLog(GUEST.ByteStream.Server):  # type: ignore[misc,name-defined]
    """The guest's side of a followed log that has nothing to say yet: its read waits."""

    def __init__(self, events: dict[str, asyncio.Event]) -> None:
        self.events = events

    async def read(self, maxBytes: int, _context: Any) -> None:
        self.events["reading"].set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.events["cancelled"].set()
            raise


class CapReader:
    """What the node's guest client gives the relay: an async iterator of a ByteStream's data."""

    def __init__(self, cap: Any) -> None:
        self._cap = cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            r = await self._cap.read(0)
            if r.eof:
                return
            yield bytes(r.data)


async def _pair(bootstrap: Any) -> tuple[Any, Any, socket.socket]:
    """A two-party connection over a socketpair: its server, its client, the client's socket."""
    a, b = socket.socketpair()
    server = capnp.TwoPartyServer(await capnp.AsyncIoStream.create_connection(sock=a),
                                  bootstrap=bootstrap)
    client = capnp.TwoPartyClient(await capnp.AsyncIoStream.create_connection(sock=b))
    return server, client, b


class GuestRoot(GUEST.GuestService.Server):  # type: ignore[misc,name-defined]
    """The guest's Logs: a FollowedLog, as a capability of the results."""

    def __init__(self, events: dict[str, asyncio.Event]) -> None:
        self.events = events

    async def logs(self, name: str, source: Any, follow: bool, _context: Any) -> None:
        stream = FollowedLog(self.events)
        weakref.finalize(stream, self.events["freed"].set)
        _context.results.stream = stream


class FakeGuest:
    """The node's guest client's `logs`, over a real connection to GuestRoot."""

    def __init__(self) -> None:
        self.events = {k: asyncio.Event() for k in ("reading", "cancelled", "freed")}
        self.held: list[Any] = []

    async def logs(self, container: str, which: str, *, follow: bool) -> CapReader:
        if not self.held:
            server, client, _ = await _pair(GuestRoot(self.events))
            self.held += [server, client.bootstrap().cast_as(GUEST.GuestService), client]
        r = await self.held[1].logs(container, which, follow)
        return CapReader(r.stream)


async def _ended(relay: Relay) -> None:
    if relay.pumps:
        await asyncio.wait(relay.pumps)


def _pumps() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "Relay._pump" in repr(t.get_coro())]


class FakePods:
    """PodLogs as the pod service answers it, without the trip to trio."""

    def __init__(self) -> None:
        self.guest = FakeGuest()
        self.relays: list[Relay] = []

    @on_rpc_thread
    async def pod_logs(self, params: dict[str, Any]) -> dict[str, Any]:
        self.relays.append(await open_logs(self.guest, params["container"], params["follow"]))
        return {"stream": Cap(_schema.pod().ByteStream, self.relays[-1])}


async def _caller_goes(bridge: CapnpThread, hang_up: str) -> dict[str, Any]:
    pods = FakePods()
    server, client, sock = await _pair(serve(_schema.pod().PodService, pods, bridge))
    service = client.bootstrap().cast_as(_schema.pod().PodService)
    stream = (await service.podLogs(id="p", container="app", follow=True)).stream
    pending = [asyncio.ensure_future(stream.read())]
    guest, relay = pods.guest, pods.relays[0]
    async with asyncio.timeout(10):
        await guest.events["reading"].wait()
        before = (len(relay.pumps), len(_pumps()))
        if hang_up == "connection":
            sock.shutdown(socket.SHUT_RDWR)  # the caller's process ends
        else:
            pending[0].cancel()  # the caller lets go of the stream, its connection stays
            await asyncio.gather(*pending, return_exceptions=True)
            pending.clear()  # a call holds its target
            del stream
        await guest.events["cancelled"].wait()
        await guest.events["freed"].wait()
        await _ended(relay)
    await asyncio.gather(*pending, return_exceptions=True)
    server.close()
    client.close()
    return {"before": before, "after": (len(relay.pumps), len(_pumps()))}


async def test_a_caller_that_drops_its_connection_leaves_no_pump() -> None:
    async with capnp_thread() as bridge:
        seen = await bridge.call(_caller_goes, bridge, "connection")
    assert seen == {"before": (2, 2), "after": (0, 0)}


async def test_a_caller_that_releases_the_stream_leaves_no_pump() -> None:
    async with capnp_thread() as bridge:
        seen = await bridge.call(_caller_goes, bridge, "release")
    assert seen == {"before": (2, 2), "after": (0, 0)}


async def test_released_from_another_thread_ends_the_pumps_on_theirs() -> None:
    async with capnp_thread() as bridge:

        async def open_relay() -> Relay:
            return await open_logs(FakeGuest(), "app", True)

        relay = await bridge.call(open_relay)
        relay.released()  # here on trio's thread, as a finalizer may run

        async def wait_ended() -> int:
            await _ended(relay)
            return len(_pumps())

        assert await bridge.call(wait_ended) == 0
