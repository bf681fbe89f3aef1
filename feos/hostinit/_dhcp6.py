"""The DHCPv6 client: an address, a delegated prefix, resolvers and NTP servers for eth0.

Theory of operation. One loop per boot, forever: Solicit (IA_NA and IA_PD) until a server
advertises, Request what it advertised (an address, a prefix, or both: a server without
prefix delegation answers IA_PD with NoPrefixAvail, and the node takes the address alone), then
hold the lease: Renew to that server from T1, Rebind to any from T2, and when the lease ends,
report it gone and Solicit again. Each change is handed to `on_change` (the caller configures
the link and tells feosd). Retransmissions double from one second up to two minutes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable

import attrs

from feos.errors import FeosError

from . import _dhcp6wire as w
from ._plan import lease6_timers

log = logging.getLogger("feos.hostinit.dhcp6")

SERVERS = "ff02::1:2"
CLIENT_PORT, SERVER_PORT = 546, 547
RT_MAX_S = 120.0
# A message that cannot be sent yet (the link-local address still tentative, a second or two
# after the link comes up) is tried again this soon, not after a retransmission's wait.
SEND_AGAIN_S = 0.2


@attrs.frozen
class Lease6:
    server_id: bytes
    address: w.Address | None
    prefix: w.Prefix | None
    dns: tuple[ipaddress.IPv6Address, ...]
    ntp: tuple[ipaddress.IPv6Address | str, ...]
    t1: float  # loop times
    t2: float
    end: float
    ia_na: w.IA | None
    ia_pd: w.IA | None


OnChange = Callable[[Lease6 | None], Awaitable[None]]


def _socket(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
    sock.bind(("::", CLIENT_PORT))
    sock.setblocking(False)
    return sock


def _spans(ia: w.IA) -> list[tuple[int, int]]:
    return [(a.preferred, a.valid) for a in ia.addresses] + [
        (p.preferred, p.valid) for p in ia.prefixes
    ]


class Dhcp6Client:
    def __init__(self, ifname: str, mac: bytes, on_change: OnChange) -> None:
        self._ifname = ifname
        self._scope = socket.if_nametoindex(ifname)
        self._duid = w.duid_ll(mac)
        self._on_change = on_change
        self._sock = _socket(ifname)
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        self._sock.close()

    async def run(self) -> None:
        while True:
            lease = await self._acquire()
            await self._on_change(lease)
            await self._keep(lease)
            log.warning("DHCPv6: the lease ended; asking again")
            await self._on_change(None)

    # One exchange: send until an answer of `want` for our xid comes, within `until`.

    async def _exchange(
        self, build: Callable[[int, int], bytes], want: int, until: float, rt: float = 1.0
    ) -> w.Message | None:
        xid = int.from_bytes(os.urandom(3), "big")
        start = self._loop.time()
        while self._loop.time() < until:
            elapsed = int((self._loop.time() - start) * 100)
            try:
                await self._loop.sock_sendto(
                    self._sock, build(xid, elapsed), (SERVERS, SERVER_PORT, 0, self._scope)
                )
            except OSError as exc:  # no link-local address yet (DAD), no carrier:
                log.debug("DHCPv6: cannot send yet: %s", exc)  # sent once it can be
                await asyncio.sleep(SEND_AGAIN_S)
                continue
            wait = min(rt, until - self._loop.time())
            got = await self._answer(xid, want, wait)
            if got is not None:
                return got
            rt = min(rt * 2, RT_MAX_S)
        return None

    async def _answer(self, xid: int, want: int, wait: float) -> w.Message | None:
        deadline = self._loop.time() + max(wait, 0.0)
        while (left := deadline - self._loop.time()) > 0:
            try:
                data = await asyncio.wait_for(self._loop.sock_recv(self._sock, 65535), left)
            except TimeoutError:
                return None
            try:
                msg = w.decode(data)
            except FeosError as exc:
                log.warning("DHCPv6: a malformed answer ignored: %s", exc)
                continue
            if msg.xid == xid and msg.kind == want and msg.client_id == self._duid:
                return msg
        return None

    async def _acquire(self) -> Lease6:
        rt = 1.0
        while True:
            adv = await self._exchange(
                lambda xid, el: w.encode(
                    w.SOLICIT, xid, self._duid, ia_na=w.IA(0, 0), ia_pd=w.IA(0, 0), elapsed_cs=el
                ),
                w.ADVERTISE,
                until=self._loop.time() + RT_MAX_S,
                rt=rt,
            )
            if adv is None or not adv.server_id:
                continue
            ia_na = adv.ia_na if adv.ia_na and adv.ia_na.addresses else None
            ia_pd = adv.ia_pd if adv.ia_pd and adv.ia_pd.prefixes else None
            if ia_pd is None:
                why = adv.ia_pd.message if adv.ia_pd else "no IA_PD in the answer"
                log.warning("DHCPv6: the server delegates no prefix (%s)", why or "NoPrefixAvail")
            if ia_na is None and ia_pd is None:
                log.warning("DHCPv6: the server offers neither an address nor a prefix")
                await asyncio.sleep(rt)
                rt = min(rt * 2, RT_MAX_S)
                continue

            def request(
                xid: int,
                el: int,
                s: bytes = adv.server_id,
                a: w.IA | None = ia_na,
                p: w.IA | None = ia_pd,
            ) -> bytes:
                return w.encode(
                    w.REQUEST, xid, self._duid, server_id=s, ia_na=a, ia_pd=p, elapsed_cs=el
                )

            reply = await self._exchange(request, w.REPLY, until=self._loop.time() + 30.0)
            lease = None if reply is None else self._lease(reply, adv.server_id)
            if lease is not None:
                return lease

    def _lease(self, reply: w.Message, server_id: bytes) -> Lease6 | None:
        ia_na = reply.ia_na if reply.ia_na and reply.ia_na.addresses else None
        ia_pd = reply.ia_pd if reply.ia_pd and reply.ia_pd.prefixes else None
        ias = [ia for ia in (ia_na, ia_pd) if ia is not None]
        if not ias:
            log.warning("DHCPv6: a reply without an address or a prefix: %s", reply.message)
            return None
        timers = [lease6_timers(ia.t1, ia.t2, _spans(ia)) for ia in ias]
        now = self._loop.time()
        return Lease6(
            server_id=reply.server_id or server_id,
            address=ia_na.addresses[0] if ia_na else None,
            prefix=ia_pd.prefixes[0] if ia_pd else None,
            dns=reply.dns,
            ntp=reply.ntp,
            t1=now + min(t.t1 for t in timers),
            t2=now + min(t.t2 for t in timers),
            end=now + min(t.end for t in timers),
            ia_na=ia_na,
            ia_pd=ia_pd,
        )

    async def _keep(self, lease: Lease6) -> None:
        """Renew from T1, rebind from T2; back when the lease ends (or a renewal changed it)."""
        while True:
            await asyncio.sleep(max(0.0, min(lease.t1, 1e9) - self._loop.time()))
            renewed = await self._extend(lease, w.RENEW, until=lease.t2)
            if renewed is None:
                renewed = await self._extend(lease, w.REBIND, until=lease.end)
            if renewed is None:
                await asyncio.sleep(max(0.0, lease.end - self._loop.time()))
                return
            if (renewed.address, renewed.prefix) != (lease.address, lease.prefix) or (
                renewed.dns,
                renewed.ntp,
            ) != (lease.dns, lease.ntp):
                await self._on_change(renewed)
            lease = renewed

    async def _extend(self, lease: Lease6, kind: int, until: float) -> Lease6 | None:
        server = lease.server_id if kind == w.RENEW else b""
        reply = await self._exchange(
            lambda xid, el: w.encode(
                kind,
                xid,
                self._duid,
                server_id=server,
                ia_na=lease.ia_na,
                ia_pd=lease.ia_pd,
                elapsed_cs=el,
            ),
            w.REPLY,
            until=min(until, 1e18),
            rt=10.0,
        )
        return None if reply is None else self._lease(reply, lease.server_id)
