"""The pods' addresses (node.md, "Addresses"): an IPv6 counter and an IPv4 allocator.

Theory of operation. Each allocator is a frozen value (the pure core) and a small file. Handing
out an address computes the next value, writes it whole to the file (tmp, fsync, rename, fsync of
the directory) and only then returns the address, so a crash between the write and the pod's own
record loses at most that address for a while, never hands it out twice:

- IPv6: the file holds the next address of the prefix, from ::2 on; at start the counter also
  goes past every address a kept pod holds. An address lost to a crash is never used again.
- IPv4: the file holds the lowest address never handed out and the addresses freed since, the
  longest free first, each with when it was freed. The range's first and last are never handed
  out. At start, an address below the lowest-never-handed-out that no kept pod holds and that is
  not recorded free (its pod was deleted, or the crash above) is free from then on.

The file I/O blocks (fsync): the caller runs `allocate`, `release` and `load` on a worker thread
(trio.to_thread.run_sync), one call at a time.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from feos.errors import Code, FeosError
from feos.records import write_whole

IPV6_FILE = "next-ipv6-address"
IPV4_FILE = "ipv4-addresses"

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


def _exhausted(what: str) -> FeosError:
    return FeosError(Code.RESOURCE_EXHAUSTED, f"the pods' {what} has no address left to hand out")


# --- IPv6 -----------------------------------------------------------------------------------


@attrs.frozen
class Ipv6Counter:
    """The next IPv6 address of the prefix to hand out."""

    prefix: ipaddress.IPv6Network
    next: V6

    @classmethod
    def start(cls, prefix: ipaddress.IPv6Network, stored: V6 | None, kept: Iterable[V6]) -> (
        Ipv6Counter
    ):
        """The counter at feosd's start: past ::1, the stored value and every kept address."""
        floor = int(prefix.network_address) + 2
        ours = [int(a) + 1 for a in kept if a in prefix]
        if stored is not None and stored in prefix:
            ours.append(int(stored))
        return cls(prefix, V6(max([floor, *ours])))

    def take(self) -> tuple[V6, Ipv6Counter]:
        """The address to hand out and the counter to write before it is handed out."""
        if int(self.next) > int(self.prefix.broadcast_address):
            raise _exhausted(f"IPv6 prefix {self.prefix}")
        return self.next, Ipv6Counter(self.prefix, V6(int(self.next) + 1))

    def encode(self) -> bytes:
        return f"{self.next}\n".encode()


def decode_ipv6_counter(data: bytes) -> V6 | None:
    """The stored next address, or None for a file that holds none (a torn or foreign file)."""
    try:
        return V6(data.decode().strip())
    except (UnicodeDecodeError, ValueError):
        return None


class Ipv6Allocator:
    """The IPv6 counter and its file; not thread-safe: one caller at a time."""

    def __init__(self, directory: Path, prefix: ipaddress.IPv6Network, kept: Iterable[V6]) -> None:
        self.path = directory / IPV6_FILE
        stored = decode_ipv6_counter(self.path.read_bytes()) if self.path.exists() else None
        self.state = Ipv6Counter.start(prefix, stored, kept)
        if stored != self.state.next:
            write_whole(self.path, self.state.encode())

    def allocate(self) -> V6:
        addr, nxt = self.state.take()
        write_whole(self.path, nxt.encode())
        self.state = nxt
        return addr


# --- IPv4 -----------------------------------------------------------------------------------


@attrs.frozen
class Ipv4Pool:
    """The lowest IPv4 address never handed out and the freed ones, the longest free first."""

    range: ipaddress.IPv4Network
    lowest_never: V4
    free: tuple[tuple[V4, float], ...] = ()

    @property
    def first(self) -> V4:
        return self.range.network_address + 1

    @property
    def last(self) -> V4:
        return self.range.broadcast_address - 1

    @classmethod
    def empty(cls, rng: ipaddress.IPv4Network) -> Ipv4Pool:
        return cls(rng, rng.network_address + 1)

    def handed_out(self, addr: V4) -> bool:
        """Whether `addr` is held by a pod as far as this pool knows."""
        return self.first <= addr < self.lowest_never and addr not in {a for a, _ in self.free}

    def take(self) -> tuple[V4, Ipv4Pool]:
        """The address to hand out and the pool to write before it is handed out."""
        if self.lowest_never <= self.last:
            return self.lowest_never, attrs.evolve(self, lowest_never=self.lowest_never + 1)
        if self.free:
            return self.free[0][0], attrs.evolve(self, free=self.free[1:])
        raise _exhausted(f"IPv4 range {self.range}")

    def release(self, addr: V4, now: float) -> Ipv4Pool:
        """The pool with `addr` free since `now`; an address not handed out changes nothing."""
        if not self.handed_out(addr):
            return self
        return attrs.evolve(self, free=(*self.free, (addr, now)))

    def recover(self, kept: Iterable[V4], now: float) -> Ipv4Pool:
        """At start: what no kept pod holds and is not free is free from `now` on."""
        held = {a for a in kept if self.first <= a <= self.last}
        lowest = max([self.lowest_never, *(a + 1 for a in held)])
        free = [(a, w) for a, w in self.free if a not in held and self.first <= a < lowest]
        known = held | {a for a, _ in free}
        lost = [(V4(i), now) for i in range(int(self.first), int(lowest)) if V4(i) not in known]
        return attrs.evolve(self, lowest_never=lowest, free=(*free, *lost))

    def encode(self) -> bytes:
        doc = {"range": str(self.range), "lowest-never-handed-out": str(self.lowest_never),
               "free": [[str(a), w] for a, w in self.free]}
        return (json.dumps(doc) + "\n").encode()


def decode_ipv4_pool(data: bytes, rng: ipaddress.IPv4Network) -> Ipv4Pool:
    """The stored pool; a file of another range, or one that does not parse, starts afresh."""
    try:
        doc = json.loads(data)
        if ipaddress.IPv4Network(doc["range"]) != rng:
            return Ipv4Pool.empty(rng)
        lowest = V4(doc["lowest-never-handed-out"])
        free = tuple((V4(a), float(w)) for a, w in doc["free"])
    except (ValueError, KeyError, TypeError):
        return Ipv4Pool.empty(rng)
    if not rng.network_address + 1 <= lowest <= rng.broadcast_address:
        return Ipv4Pool.empty(rng)
    return Ipv4Pool(rng, lowest, free)


class Ipv4Allocator:
    """The IPv4 pool and its file; not thread-safe: one caller at a time."""

    def __init__(self, directory: Path, rng: ipaddress.IPv4Network, kept: Iterable[V4],
                 clock: Callable[[], float] = time.time) -> None:
        self.path = directory / IPV4_FILE
        self.clock = clock
        stored = (decode_ipv4_pool(self.path.read_bytes(), rng) if self.path.exists()
                  else Ipv4Pool.empty(rng))
        self.state = stored.recover(kept, clock())
        if self.state != stored or not self.path.exists():
            write_whole(self.path, self.state.encode())

    def allocate(self) -> V4:
        addr, nxt = self.state.take()
        write_whole(self.path, nxt.encode())
        self.state = nxt
        return addr

    def release(self, addr: V4) -> None:
        nxt = self.state.release(addr, self.clock())
        if nxt != self.state:
            write_whole(self.path, nxt.encode())
            self.state = nxt
