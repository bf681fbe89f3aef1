"""The uplink's addresses and routes, by netlink (pyroute2's AsyncIPRoute, one per change, on
host-init's one event loop). Each change replaces what is there, so a renewal that repeats a
lease changes nothing."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from ._plan import Route4

log = logging.getLogger("feos.hostinit")

RTN_UNREACHABLE = 7


async def _index(ipr: AsyncIPRoute, ifname: str) -> int:
    found = await ipr.link_lookup(ifname=ifname)
    if not found:
        raise OSError(errno.ENODEV, f"no link {ifname}")
    return int(found[0])


async def up(ifname: str) -> None:
    async with AsyncIPRoute() as ipr:
        await ipr.link("set", index=await _index(ipr, ifname), state="up")


async def set_address4(ifname: str, address: ipaddress.IPv4Interface, routes: list[Route4]) -> None:
    async with AsyncIPRoute() as ipr:
        index = await _index(ipr, ifname)
        await ipr.addr(
            "replace",
            index=index,
            address=str(address.ip),
            prefixlen=address.network.prefixlen,
            broadcast=str(address.network.broadcast_address),
        )
        for r in routes:
            dst = "0.0.0.0/0" if r.dst is None else str(r.dst)
            if r.gateway is None:
                await ipr.route("replace", dst=dst, oif=index, scope=253)  # on the link
            else:
                await ipr.route("replace", dst=dst, gateway=str(r.gateway), oif=index)


async def remove_address(
    ifname: str, address: ipaddress.IPv4Interface | ipaddress.IPv6Interface
) -> None:
    async with AsyncIPRoute() as ipr:
        try:
            await ipr.addr(
                "del",
                index=await _index(ipr, ifname),
                address=str(address.ip),
                prefixlen=address.network.prefixlen,
            )
        except NetlinkError as exc:
            if exc.code not in (errno.EADDRNOTAVAIL, errno.ESRCH, errno.ENODEV):
                raise


async def set_address6(
    ifname: str, address: ipaddress.IPv6Address, preferred: int, valid: int
) -> None:
    async with AsyncIPRoute() as ipr:
        await ipr.addr(
            "replace",
            index=await _index(ipr, ifname),
            address=str(address),
            prefixlen=128,
            family=socket.AF_INET6,
            IFA_CACHEINFO={
                "ifa_preferred": preferred,
                "ifa_valid": valid,
                "cstamp": 0,
                "tstamp": 0,
            },
        )


async def route_unreachable(prefix: ipaddress.IPv6Network, add: bool = True) -> None:
    """The delegated prefix routed as unreachable: the pods' /128s are longer and win, and
    the rest of it is not sent back to the router."""
    async with AsyncIPRoute() as ipr:
        try:
            await ipr.route(
                "replace" if add else "del",
                dst=str(prefix),
                family=socket.AF_INET6,
                type=RTN_UNREACHABLE,
            )
        except NetlinkError as exc:
            if add or exc.code != errno.ESRCH:
                raise


async def addresses(ifname: str) -> list[str]:
    """The link's global addresses, for the log."""
    async with AsyncIPRoute() as ipr:
        index = await _index(ipr, ifname)
        out = []
        async for msg in await ipr.addr("dump", index=index):
            if msg["scope"] == 0:
                out.append(f"{msg.get('IFA_ADDRESS')}/{msg['prefixlen']}")
        return out
