"""The DHCPv4 client: pyroute2's (AsyncDHCPClient, its state machine and messages), told what
host-init does with a lease. It renews at T1, rebinds at T2, and when a lease ends or no server
answers it asks again (a DISCOVER with a new xid, retransmitted up to every 32 s), without end.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pyroute2.dhcp import fsm
from pyroute2.dhcp.client import AsyncDHCPClient, ClientConfig
from pyroute2.dhcp.enums import dhcp
from pyroute2.dhcp.hooks import Hook, Trigger
from pyroute2.dhcp.leases import Lease

log = logging.getLogger("feos.hostinit.dhcp4")

OnLease = Callable[
    [
        ipaddress.IPv4Interface,
        list[ipaddress.IPv4Address],
        list[ipaddress.IPv4Address],
        list[ipaddress.IPv4Address],
    ],
    Awaitable[None],
]
OffLease = Callable[[], Awaitable[None]]


class _MemoryLease(Lease):  # type: ignore[misc]
    """A lease kept in memory only: the node has no disk to find it on at its next boot."""

    def dump(self) -> None:
        pass

    @classmethod
    def load(cls, interface: str) -> None:
        return None


def _ips(options: dict[str, Any], name: str) -> list[ipaddress.IPv4Address]:
    return [ipaddress.IPv4Address(a) for a in options.get(name) or []]


def lease_facts(
    ack: dict[str, Any],
) -> tuple[
    ipaddress.IPv4Interface,
    list[ipaddress.IPv4Address],
    list[ipaddress.IPv4Address],
    list[ipaddress.IPv4Address],
]:
    """The address with its prefix, routers, resolvers and NTP servers of an ACK."""
    options = ack["options"]
    mask = options.get("subnet_mask") or "255.255.255.255"
    address = ipaddress.IPv4Interface(f"{ack['yiaddr']}/{mask}")
    return (
        address,
        _ips(options, "router"),
        _ips(options, "name_server"),
        _ips(options, "ntp_servers"),
    )


async def run_client(ifname: str, on_lease: OnLease, off_lease: OffLease) -> None:
    async def bound(lease: Lease) -> None:
        await on_lease(*lease_facts(lease.ack))

    async def unbound(lease: Lease) -> None:
        await off_lease()

    config = ClientConfig(
        interface=ifname,
        lease_type=_MemoryLease,
        hooks=(
            Hook(bound, {Trigger.BOUND, Trigger.RENEWED, Trigger.REBOUND}),
            Hook(unbound, {Trigger.UNBOUND, Trigger.EXPIRED}),
        ),
        requested_parameters=(
            dhcp.Option.SUBNET_MASK,
            dhcp.Option.ROUTER,
            dhcp.Option.NAME_SERVER,
            dhcp.Option.NTP_SERVERS,
            dhcp.Option.LEASE_TIME,
            dhcp.Option.RENEWAL_TIME,
            dhcp.Option.REBINDING_TIME,
        ),
        timeouts={fsm.State.REBOOTING: 10, fsm.State.REQUESTING: 30, fsm.State.SELECTING: 60},
        handle_signals=False,
        release=False,
        hook_timeout=10.0,
        vendor_id="feos-host-init",
    )
    async with AsyncDHCPClient(config) as client:
        await client.bootstrap()
        await asyncio.Event().wait()
