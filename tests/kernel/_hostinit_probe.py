"""Run in the node's namespace by test_hostinit_net.py: host-init's DHCPv4 and DHCPv6 clients
and its link changes on one link, then NTP by the servers they named; the outcome as JSON."""

from __future__ import annotations

import asyncio
import json
import sys

from feos.hostinit import _dhcp6, _link, _ntp, _system
from feos.hostinit._dhcp4 import run_client
from feos.hostinit._plan import lease4_routes, ntp_order


async def query(server: object) -> float:
    """NTP once the route is there (IPv6's comes with the router's advertisement)."""
    for _ in range(40):
        try:
            return await _ntp.query(server)  # type: ignore[arg-type]
        except OSError:
            await asyncio.sleep(0.5)
    return await _ntp.query(server)  # type: ignore[arg-type]


async def main(ifname: str, wait6: float) -> None:
    out: dict[str, object] = {}
    await _link.up(ifname)
    got4, got6 = asyncio.Event(), asyncio.Event()
    ntp4: list[object] = []
    ntp6: list[object] = []

    async def on4(addr, routers, dns, ntp):  # type: ignore[no-untyped-def]
        await _link.set_address4(ifname, addr, lease4_routes(addr, routers))
        out["v4"] = {"address": str(addr), "routers": [str(r) for r in routers],
                     "dns": [str(d) for d in dns]}
        ntp4[:] = ntp
        got4.set()

    async def off4() -> None:
        out["v4_ended"] = True

    async def on6(lease):  # type: ignore[no-untyped-def]
        if lease is not None:
            if lease.address is not None:
                a = lease.address
                await _link.set_address6(ifname, a.address, a.preferred, a.valid)
            if lease.prefix is not None:
                await _link.route_unreachable(lease.prefix.prefix)
            out["v6"] = {"address": str(lease.address.address) if lease.address else None,
                         "prefix": str(lease.prefix.prefix) if lease.prefix else None,
                         "dns": [str(d) for d in lease.dns]}
            ntp6[:] = lease.ntp
        got6.set()

    t4 = asyncio.create_task(run_client(ifname, on4, off4))
    client = _dhcp6.Dhcp6Client(ifname, _system.mac_of(ifname), on6)
    t6 = asyncio.create_task(client.run())
    await asyncio.wait_for(got4.wait(), 60)
    try:
        await asyncio.wait_for(got6.wait(), wait6)
    except TimeoutError:
        out["v6"] = None
    out["addresses"] = await _link.addresses(ifname)
    servers = ntp_order(ntp6, ntp4)[:-2]  # not pool.ntp.org: nothing leaves the namespace
    out["ntp"] = [(s.host, s.family, await query(s)) for s in servers]
    print(json.dumps(out))
    for t in (t4, t6):
        t.cancel()
    client.close()


asyncio.run(main(sys.argv[1], float(sys.argv[2])))
