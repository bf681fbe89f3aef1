"""The guest link: the node's side of one microVM's guest, from its creation to its deletion.

Theory of operation. One `GuestLink` per microVM runs in the service's nursery. It dials the
guest link (QEMU's guest.sock) again and again, backing off while there is no VMM, and at once
when kicked (a start, a resume). A session is the guest client's (feos.guestlink.GuestClient, on the
Cap'n Proto thread, reached through the bridge): the agent's hello, then RPC, then its attach.
After each attach the link pushes the wall time and, when the pod has an address, its network
configuration, then says so (`on_attach`); after a resume it pings once first instead. While a
session lives the clock loop keeps the guest's clock; when it ends (the VMM ended, the agent
restarted) the link dials again.

The clock's arithmetic is pure (ADR 0027): four GetTime calls once a minute, the shortest round
trip kept, dropped above 10 ms; the offset is the guest's time minus the middle of that call on
the node's CLOCK_REALTIME (positive: the guest is ahead). AdjustTime moves the guest's clock by
its argument, so it gets the offset negated; a guest that answers UNIMPLEMENTED is stepped with
SetTime when it is off by more than 20 ms. The samples are taken on the Cap'n Proto thread, so
that the bridge's hops do not count in the round trip.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

log = logging.getLogger("feos.vmm.guest")

SAMPLES = 4
MAX_ROUND_TRIP_NS = 10_000_000
SET_TIME_ABOVE_NS = 20_000_000
CLOCK_INTERVAL_S = 60.0
CLOCK_CALL_S = 5.0
PUSH_S = 10.0
RESUME_PING_S = 30.0
ATTACH_S = 5.0  # after the hello, the agent's attach
PARK_S = 1.0  # before a suspend: until the guest has read what the node sent
BACKOFF_MIN_S = 0.02
BACKOFF_MAX_S = 2.0


# -- the clock, pure ---------------------------------------------------------------------------


@attrs.frozen
class Sample:
    real_before_ns: int  # the node's CLOCK_REALTIME when the call went out
    guest_ns: int  # the guest's CLOCK_REALTIME as it answered
    round_trip_ns: int  # CLOCK_MONOTONIC after minus before


@attrs.frozen
class Measurement:
    offset_ns: int  # guest minus node
    round_trip_ns: int


def offset_of(sample: Sample) -> int:
    """The guest's time minus the middle of the call on the node's wall clock."""
    return sample.guest_ns - (sample.real_before_ns + sample.round_trip_ns // 2)


def measure(samples: Sequence[Sample]) -> Measurement | None:
    """The shortest round trip's offset; None with no sample or when even that took over 10 ms."""
    good = [s for s in samples if s.round_trip_ns >= 0]
    if not good:
        return None
    best = min(good, key=lambda s: s.round_trip_ns)
    if best.round_trip_ns > MAX_ROUND_TRIP_NS:
        return None
    return Measurement(offset_of(best), best.round_trip_ns)


def correction(m: Measurement) -> int:
    """AdjustTime's argument: the guest's clock moves by it (positive: forward)."""
    return -m.offset_ns


def needs_set_time(m: Measurement) -> bool:
    """After AdjustTime answered UNIMPLEMENTED: is the guest off enough to be stepped?"""
    return abs(m.offset_ns) > SET_TIME_ABOVE_NS


@attrs.frozen
class ClockStep:
    """What one round of the clock loop did, for logs and tests."""

    measurement: Measurement | None
    action: str  # "dropped", "adjusted", "set", "kept", "failed"


# -- the link, on trio ---------------------------------------------------------------------------

Network = Callable[[], Awaitable[Any | None]]  # the pod's NetworkConfig, or None without address


async def _samples(client: Any, n: int) -> list[Sample]:
    """On the Cap'n Proto thread: n GetTime calls, each timed there."""
    out = []
    for _ in range(n):
        real = time.time_ns()
        mono = time.monotonic_ns()
        guest_ns = await client.get_time()
        out.append(Sample(real, guest_ns, time.monotonic_ns() - mono))
    return out


async def _wait_attached(client: Any, within: float) -> Any:
    import asyncio

    try:
        async with asyncio.timeout(within):
            return await asyncio.shield(client.attached)
    except TimeoutError:
        raise FeosError(Code.UNAVAILABLE, f"the guest did not attach within {within:g}s") from None


async def connect_poking(path: str, deadline: float = ATTACH_S) -> Any:
    """GuestClient.connect, but the node pokes at once rather than after a second of silence.

    A resumed agent is in a session it believes live and says hello only when poked; a fresh
    one takes a poke before its session's first message as answered (docs/guest.md), so the
    early poke costs a booting guest nothing and saves a resumed one the second."""
    from feos.guestlink import GuestClient

    return await GuestClient.connect(path, deadline=deadline, poke_first=True)


async def _wait_ended(client: Any) -> None:
    await client.ended.wait()


class GuestLink:
    """The node's side of one guest; `run` it in a nursery for the microVM's life."""

    def __init__(
        self,
        vm_id: str,
        path: Path,
        bridge: Any,
        *,
        network: Network | None = None,
        on_attach: Callable[[Any], None] | None = None,
        clock_interval: float = CLOCK_INTERVAL_S,
        connect: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.vm_id = vm_id
        self._path = path
        self._bridge = bridge
        self._network = network
        self._on_attach = on_attach
        self._clock_interval = clock_interval
        self._connect = connect
        self._client: Any = None
        self._changed = trio.Event()
        self._kick = trio.Event()
        self._resumed = False  # until a resumed guest answered its ping
        self._hold = False
        self._pinged = trio.Event()
        self._wake = trio.Event()  # a kick, an unpark or a drop, for a parked session
        self._parked = False  # the session holds its link for a suspend
        self._rejoined = False  # ... and dialed the resumed VMM
        self._drop = False
        self._suspending = False  # from a park until the kick, unpark or drop after it
        self._greeted_before: Any = None
        self.sessions = 0  # sessions up so far
        self.attaches = 0  # sessions greeted and pushed so far
        self._greeted: Any = None  # the client whose session was greeted
        self.last_clock: ClockStep | None = None

    @property
    def client(self) -> Any:
        return self._client

    def kick(self) -> None:
        """Dial now: a VMM has just started or resumed. A session parked for a suspend goes
        on: pinged when it was rejoined to the resumed VMM, else let go (its VMM is gone)."""
        self._hold = False
        self._kick.set()
        self._wake.set()

    async def session(self, within: float) -> Any:
        """The guest's client once a session is up and greeted (the time and the network
        pushed), within `within` seconds: no caller finds a guest without its network yet."""
        with trio.move_on_after(within):
            while self._client is None or self._greeted is not self._client:
                await self._changed.wait()
            return self._client
        raise FeosError(Code.UNAVAILABLE, f"the guest did not answer within {within:g}s")

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await self._bridge.call(fn, *args)

    def resuming(self) -> trio.Event:
        """Before the VMM resumes: its next session (which may be dialed while the snapshot
        still loads) pings once, then pushes. The event is set once the guest answered."""
        self._resumed = True
        self._hold = True  # a poke sent while QEMU still loads the snapshot would be lost
        self._pinged = trio.Event()
        return self._pinged

    # -- across a suspend -------------------------------------------------------------------

    async def park(self) -> bool:
        """Before a suspend stops the VMM: the session holds its bytes at a message boundary
        until the guest has read all it was sent (SwapLink), so that it can go on over the
        resumed VMM's link. Until then no caller gets the client. False: not kept."""
        client = self._client
        self._greeted_before, self._greeted = self._greeted, None
        self._signal()
        self._parked = self._rejoined = self._drop = False
        self._suspending = True
        if client is None or not hasattr(client, "park"):
            return False
        try:
            with trio.fail_after(PARK_S + 1):
                self._parked = bool(await self.call(client.park, PARK_S))
        except (FeosError, trio.TooSlowError) as exc:
            log.info("guest of %s: the link could not be held for the suspend: %s",
                     self.vm_id, exc)  # fmt: skip
        if not self._parked:
            log.info("guest of %s: the guest did not read the link within %gs; its session "
                     "ends with the suspend", self.vm_id, PARK_S)  # fmt: skip
        return self._parked

    async def rejoin(self) -> bool:
        """The resumed VMM has loaded the snapshot and waits paused: the parked session dials
        its guest.sock and goes on over it. True if it did; the VM may run then, and `kick`
        pings the guest through the same session. False: a new session after the resume."""
        client = self._client
        if not self._parked or client is None or not hasattr(client, "rejoin"):
            return False
        try:
            with trio.fail_after(PUSH_S):
                await self.call(client.rejoin, str(self._path))
        except (FeosError, trio.TooSlowError) as exc:
            log.info("guest of %s: the session could not rejoin: %s", self.vm_id, exc)
            return False
        self._rejoined = True
        return True

    def unpark(self) -> None:
        """The suspend did not happen (it failed, or its late snapshot was given up): the
        session goes on over the same VMM, greeted as it was."""
        if not self._parked:
            self._regreet()
        self._wake.set()

    def _regreet(self) -> None:
        if self._client is not None and self._greeted_before is self._client:
            self._greeted = self._client
            self._signal()

    def drop(self) -> None:
        """A resume failed after the session rejoined: end it (its VMM is gone, and what the
        guest sent may come again from the next one); the next resume's session is new."""
        self._drop = True
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        client: Any = None
        while True:
            if client is None:
                while self._hold:
                    await self._kick.wait()
                    self._kick = trio.Event()
                try:
                    client = await self.call(self._connect or connect_poking, str(self._path))
                except FeosError as exc:
                    log.debug("guest of %s: %s", self.vm_id, exc.message)
                    backoff = await self._back_off(backoff)
                    continue
            backoff = BACKOFF_MIN_S
            try:
                await self._serve(client)
            finally:
                self._set_client(None)
                self._parked = self._rejoined = self._drop = self._suspending = False
                t0 = time.monotonic()
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self.call(client.close)
                    except FeosError as exc:  # the bridge stops with feosd (a parked session)
                        log.debug("guest of %s: closing the session: %s", self.vm_id, exc)
                log.debug("guest of %s: the session closed in %.1f ms", self.vm_id,
                          1000 * (time.monotonic() - t0))
            # A new hello from the agent is not taken up on the same connection: what the
            # node's old session still sent would reach the agent's new one. A new dial makes
            # the port drop all of that (the agent reads EOF), then the new session starts.
            client = None

    async def _back_off(self, backoff: float) -> float:
        with trio.move_on_after(backoff):
            await self._kick.wait()
        if self._kick.is_set():
            self._kick = trio.Event()
            return BACKOFF_MIN_S
        return min(BACKOFF_MAX_S, backoff * 2)

    async def _serve(self, client: Any) -> None:
        self.sessions += 1
        self._set_client(client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._greet, client)
            nursery.start_soon(self._clock_loop, client)
            nursery.start_soon(self._across_suspends, client, nursery)
            await self.call(_wait_ended, client)
            nursery.cancel_scope.cancel()
        log.info("guest of %s: the session ended", self.vm_id)

    async def _across_suspends(self, client: Any, nursery: trio.Nursery) -> None:
        """After each park: on the kick that follows, a rejoined session sends again and
        greets the resumed guest; one not rejoined is let go, and ends if its VMM is gone."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            self._suspending = False
            if not self._parked:
                continue
            if self._drop:
                nursery.cancel_scope.cancel()
                return
            rejoined, self._parked, self._rejoined = self._rejoined, False, False
            try:
                await self.call(client.unpark)
            except FeosError as exc:  # only when the bridge stops: the session ends with it
                log.debug("guest of %s: unparking the session: %s", self.vm_id, exc)
                nursery.cancel_scope.cancel()
                return
            if rejoined:
                nursery.start_soon(self._greet, client)
            elif not self._resumed:  # the suspend did not happen: greeted as it was
                self._regreet()

    async def _greet(self, client: Any) -> None:
        """A resumed guest is pinged once (30 s: its memory may come page by page); a booted
        one is waited for until it attaches. Then the wall time and the network are pushed."""
        resumed = self._resumed
        try:
            if resumed:
                with trio.fail_after(RESUME_PING_S):
                    await self.call(client.ping)
                self._resumed = False
                self._pinged.set()
            else:
                await self.call(_wait_attached, client, ATTACH_S)
        except (FeosError, trio.TooSlowError) as exc:
            log.warning("guest of %s did not answer its %s: %s", self.vm_id,
                        "ping after the resume" if resumed else "attach", exc)  # fmt: skip
            return
        await self._push(client)
        self._greeted = client
        self.attaches += 1
        self._signal()
        log.info("guest of %s attached (boot %s)", self.vm_id, getattr(client, "boot_id", "?"))
        if self._on_attach is not None:
            self._on_attach(client)

    async def _push(self, client: Any) -> None:
        """The wall time, and the network configuration when the pod has an address."""
        try:
            with trio.fail_after(PUSH_S):
                await self.call(client.set_time, time.time_ns())
                config = await self._network() if self._network is not None else None
                if config is not None:
                    await self.call(client.configure_network, config)
        except (FeosError, trio.TooSlowError) as exc:
            log.warning("guest of %s: pushing time and network failed: %s", self.vm_id, exc)

    async def wait_attach(self, after: int) -> None:
        """Until a session newer than `after` attaches has been greeted (no timeout here)."""
        while self.attaches <= after:
            await self._changed.wait()

    def _set_client(self, client: Any) -> None:
        self._client = client
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _clock_loop(self, client: Any) -> None:
        while True:
            await trio.sleep(self._clock_interval)
            if not self._suspending:  # a suspended guest would not answer
                self.last_clock = await self.keep_clock(client)

    async def keep_clock(self, client: Any) -> ClockStep:
        """One round: measure, then AdjustTime (or SetTime for a guest without it)."""
        try:
            with trio.fail_after(CLOCK_CALL_S):
                m = measure(await self.call(_samples, client, SAMPLES))
                if m is None:
                    return ClockStep(None, "dropped")
                try:
                    await self.call(client.adjust_time, correction(m))
                    return ClockStep(m, "adjusted")
                except FeosError as exc:
                    if exc.code != Code.UNIMPLEMENTED:
                        raise
                if not needs_set_time(m):
                    return ClockStep(m, "kept")
                await self.call(client.set_time, time.time_ns() + _half(m))
                return ClockStep(m, "set")
        except (FeosError, trio.TooSlowError) as exc:
            log.debug("guest of %s: the clock's round failed: %s", self.vm_id, exc)
            return ClockStep(None, "failed")


def _half(m: Measurement) -> int:
    return math.ceil(m.round_trip_ns / 2)
