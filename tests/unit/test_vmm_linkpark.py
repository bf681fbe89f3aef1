"""A guest session kept across a suspend: the node's framing (Frames), its link held at a
message boundary and moved to the resumed VMM's connection (SwapLink, over real socketpairs),
and the GuestLink's steps around it against a scripted client."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing
from _aio import idle
from hypothesis import given
from hypothesis import strategies as st
from test_vmm_guestlink import Bridge, stub_waits

from feos.guest import Frames, node_poke
from feos.guestlink import SwapLink
from feos.vmm._guestlink import GuestLink


def _message(sizes: list[int]) -> bytes:
    """A Cap'n Proto stream-framed message with segments of these sizes (in words)."""
    header = struct.pack(f"<I{len(sizes)}I", len(sizes) - 1, *sizes)
    header += b"\0" * (len(header) % 8)
    return header + b"".join(bytes([i + 1]) * 8 * n for i, n in enumerate(sizes))


_items = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=4).map(_message),
    st.text("abcdef0123", min_size=1, max_size=20).map(node_poke),
)


@given(st.lists(_items, max_size=8), st.lists(st.integers(1, 64), max_size=30))
def test_frames_give_whole_items_only_and_lose_nothing(items: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(items)
    ends = set()
    pos = 0
    for item in items:
        pos += len(item)
        ends.add(pos)
    frames = Frames()
    out = b""
    i = 0
    for cut in [*cuts, len(stream)]:
        got = frames.feed(stream[i : i + cut])
        i += cut
        out += got
        assert out == stream[: len(out)]
        assert len(out) in ends | {0}  # what went out ends at a boundary
        assert frames.pending == min(i, len(stream)) - len(out)
    assert out == stream


def test_frames_pass_on_what_they_cannot_follow() -> None:
    frames = Frames()
    junk = struct.pack("<I", 10_000) + b"x" * 20  # more segments than KJ takes
    assert frames.feed(junk) == junk
    assert frames.feed(b"more") == b"more"


# -- SwapLink over socketpairs ---------------------------------------------------------------


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, b


def _inq(sock: socket.socket) -> int:
    """The bytes waiting unread in a socket's receive queue (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


async def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = await asyncio.get_running_loop().sock_recv(sock, n - len(out))
        assert chunk, "the peer closed"
        out += chunk
    return out


def test_a_half_message_is_held_until_its_end() -> None:
    async def main() -> None:
        ours, peer = _pair()
        link = SwapLink(ours)
        msg = _message([3, 1])
        await link.send(msg[:11])
        await idle()
        try:
            peer.recv(100)
            raise AssertionError("a part of a message went out")
        except BlockingIOError:
            pass
        await link.send(msg[11:])
        assert await _read(peer, len(msg)) == msg
        link.close()
        peer.close()

    _run(main())


def test_park_waits_until_the_peer_has_read() -> None:
    async def main() -> None:
        ours, peer = _pair()
        link = SwapLink(ours)
        msg = _message([5])
        await link.send(msg)
        park = asyncio.ensure_future(link.park(2.0))
        await idle()  # park has looked at the unread bytes (and polls them on)
        assert not park.done()  # the peer has not read it yet
        assert await _read(peer, len(msg)) == msg
        assert await park is True
        assert link.parked
        link.close()
        peer.close()

    _run(main())


def test_park_gives_up_when_the_peer_does_not_read_and_sends_again() -> None:
    async def main() -> None:
        ours, peer = _pair()
        link = SwapLink(ours)
        await link.send(_message([1]))
        assert await link.park(0.05) is False
        assert not link.parked
        second = _message([2])
        await link.send(second)  # not held
        assert await _read(peer, 16 + len(second)) == _message([1]) + second
        link.close()
        peer.close()

    _run(main())


def test_a_parked_stream_goes_on_over_the_next_connection() -> None:
    async def main() -> None:
        old, old_peer = _pair()
        link = SwapLink(old)
        assert await link.park(1.0)
        held = asyncio.ensure_future(link.send(_message([4])))  # the node's RPC sends on
        await idle()
        assert not held.done()
        old_peer.sendall(b"before")  # what the guest sent before the VMM ended ...
        old_peer.close()  # ... which then quits
        assert await link.recv() == b"before"
        reading = asyncio.ensure_future(link.recv())
        await idle()
        assert not reading.done()  # the old connection's end is not the stream's
        new, new_peer = _pair()
        link.rebind(new)
        new_peer.sendall(b"after")
        assert await reading == b"after"
        link.unpark()
        await held
        assert await _read(new_peer, 40) == _message([4])
        link.close()
        new_peer.close()

    _run(main())


def test_unpark_without_a_new_connection_ends_the_stream() -> None:
    async def main() -> None:
        old, old_peer = _pair()
        link = SwapLink(old)
        assert await link.park(1.0)
        old_peer.close()
        reading = asyncio.ensure_future(link.recv())
        await idle()
        assert not reading.done()
        link.unpark()  # the resume had no session to rejoin: the stream ends here
        assert await reading == b""
        link.close()

    _run(main())


def test_unpark_of_a_live_connection_sends_again() -> None:
    async def main() -> None:
        ours, peer = _pair()
        link = SwapLink(ours)
        assert await link.park(1.0)
        held = asyncio.ensure_future(link.send(_message([1])))
        await idle()
        assert not held.done()
        link.unpark()  # the suspend failed: the same VMM runs on
        await held
        assert await _read(peer, 16) == _message([1])
        peer.sendall(b"still")
        assert await link.recv() == b"still"
        link.close()
        peer.close()

    _run(main())


# -- GuestLink's steps around a suspend -------------------------------------------------


class _Client:
    """What GuestLink needs of a GuestClient, recording the calls; `vmm_gone` is a VMM that
    ended under a parked session (a real one's stream then ends when unparked)."""

    def __init__(self, log: list[str], *, quiet: bool = True) -> None:
        self.log = log
        self.quiet = quiet
        self.boot_id = "boot"
        self.ended = trio.Event()
        self.vmm_gone = False

    async def ping(self) -> None:
        self.log.append("ping")

    async def set_time(self, ns: int) -> None:
        self.log.append("set_time")

    async def park(self, within: float) -> bool:
        self.log.append("park")
        return self.quiet

    async def rejoin(self, path: str) -> None:
        self.log.append("rejoin")
        self.vmm_gone = False

    async def unpark(self) -> None:
        self.log.append("unpark")
        if self.vmm_gone:
            self.ended.set()

    async def close(self) -> None:
        self.ended.set()


async def _linked(monkeypatch: Any, log: list[str], clients: list[_Client]) -> GuestLink:
    stub_waits(monkeypatch)

    async def connect(path: str) -> _Client:
        clients.append(_Client(log))
        return clients[-1]

    return GuestLink("abcdefghjkm", Path("/nonexistent"), Bridge(), connect=connect)


@asynccontextmanager
async def _attached(monkeypatch: Any) -> AsyncIterator[tuple[GuestLink, list[str], list[_Client]]]:
    """A link running with its first session attached; the link's run ends with the block."""
    log: list[str] = []
    clients: list[_Client] = []
    link = await _linked(monkeypatch, log, clients)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        await link.wait_attach(0)
        yield link, log, clients
        nursery.cancel_scope.cancel()


async def test_a_rejoined_session_is_pinged_without_a_new_dial(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    async with _attached(monkeypatch) as (link, log, clients):
        log.clear()
        assert await link.park()
        with trio.move_on_after(1):
            await link.session(1)
            raise AssertionError("a parked session was handed out")
        clients[0].vmm_gone = True  # the suspend ended QEMU
        pinged = link.resuming()
        assert await link.rejoin()
        link.kick()
        with trio.fail_after(1):
            await pinged.wait()
        assert await link.session(1) is clients[0]
        assert log == ["park", "rejoin", "unpark", "ping", "set_time"]
        assert len(clients) == 1 and link.sessions == 1


async def test_a_session_not_rejoined_ends_and_the_resume_dials(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    async with _attached(monkeypatch) as (link, _log, clients):
        assert await link.park()
        clients[0].vmm_gone = True
        pinged = link.resuming()
        link.kick()  # a driver that rejoins nothing (Firecracker), or a new feosd
        with trio.fail_after(1):
            await pinged.wait()
        assert len(clients) == 2  # a new session, pinged as a resumed guest is
        assert clients[1].log[-2:] == ["ping", "set_time"]


async def test_a_failed_suspend_unparks_the_same_session(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    async with _attached(monkeypatch) as (link, log, clients):
        log.clear()
        assert await link.park()
        link.unpark()
        with trio.fail_after(1):
            assert await link.session(1) is clients[0]
        assert log == ["park", "unpark"]


async def test_a_guest_that_does_not_read_is_not_kept(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    async with _attached(monkeypatch) as (link, _log, clients):
        clients[0].quiet = False
        assert not await link.park()
        assert not await link.rejoin()  # the resume starts a new session instead
        link.unpark()  # and a failed suspend keeps this one, greeted as before
        with trio.fail_after(1):
            assert await link.session(1) is clients[0]


async def test_a_failed_resume_drops_the_rejoined_session(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    async with _attached(monkeypatch) as (link, _log, clients):
        assert await link.park()
        link.resuming()
        assert await link.rejoin()
        link.drop()  # QEMU died between the load and cont
        with trio.fail_after(1):
            await clients[0].ended.wait()
        await trio.sleep(10)  # the autojump clock's ten seconds: no retry timer dials meanwhile
        assert len(clients) == 1  # held: no dial until the next resume kicks


# -- with a real agent (a process on the host) and a relay in QEMU's place -------------------


async def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copies both ways, as QEMU's virtio-serial port does, until cancelled."""
    loop = asyncio.get_running_loop()

    async def copy(src: socket.socket, dst: socket.socket) -> None:
        while data := await loop.sock_recv(src, 65536):
            await loop.sock_sendall(dst, data)

    await asyncio.gather(copy(a, b), copy(b, a))


def _agent(tmp_path: Path) -> tuple[Any, socket.socket]:
    from tests.unit.test_guest_service import AgentProcess

    agent_end, relay_end = socket.socketpair()
    agent = AgentProcess(str(tmp_path), link=f"fd:{agent_end.fileno()}",
                         pass_fds=(agent_end.fileno(),))  # fmt: skip
    agent_end.close()
    relay_end.setblocking(False)
    return agent, relay_end


def test_a_real_agents_session_goes_on_over_the_next_vmms_connection(tmp_path: Path) -> None:
    import capnp  # type: ignore[import-untyped]

    from feos.guestlink import GuestClient

    agent, guest_side = _agent(tmp_path)

    async def main() -> None:
        node1, vmm1 = _pair()
        relay = asyncio.ensure_future(_relay(guest_side, vmm1))
        client = await GuestClient._start(SwapLink(node1))
        first = await client.ping()
        assert await client.park(2.0)
        await idle()  # the relay has passed on what it read ...
        assert _inq(vmm1) == 0  # ... and nothing waits for it
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        vmm1.close()  # the old VMM quit: the node reads its end and waits
        held = asyncio.ensure_future(client.ping())
        await idle()
        assert not held.done() and not client.ended.is_set()
        node2, vmm2 = _pair()
        client._link.rebind(node2)  # type: ignore[union-attr]
        relay = asyncio.ensure_future(_relay(guest_side, vmm2))
        await client.unpark()
        second = await asyncio.wait_for(held, 10)
        assert (second.boot_id, client.ended.is_set()) == (first.boot_id, False)
        assert second.uptime_ns > first.uptime_ns
        await client.close()
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        vmm2.close()

    try:
        asyncio.run(capnp.run(main()))
        assert agent.output().count("hello sent") == 1, agent.output()  # one session only
    finally:
        agent.close()
        guest_side.close()


def test_a_link_parks_again_after_an_unpark() -> None:
    async def main() -> None:
        ours, peer = _pair()
        link = SwapLink(ours)
        assert await link.park(1.0)
        link.unpark()  # a suspend that failed
        assert await link.park(1.0)  # the next one
        peer.close()
        reading = asyncio.ensure_future(link.recv())
        await idle()
        assert not reading.done()  # it waits for the resumed VMM, as the first park would
        new, new_peer = _pair()
        link.rebind(new)
        new_peer.sendall(b"x")
        assert await reading == b"x"
        link.close()
        new_peer.close()

    _run(main())


async def test_a_parked_session_ends_quietly_when_feosd_stops(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    """feosd stops while a VM is suspended: the bridge refuses the parked session's close (it
    stops first), which must not end the service with an error."""
    from feos.errors import Code, FeosError

    async with _attached(monkeypatch) as (link, _log, clients):
        assert await link.park()

        async def refused() -> None:
            raise FeosError(Code.UNAVAILABLE, "feosd stops")

        clients[0].close = refused  # type: ignore[method-assign]
        await trio.testing.wait_all_tasks_blocked()
        # the block's end cancels the link's run, as the service's end does: nothing comes out
