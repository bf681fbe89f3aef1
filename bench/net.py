"""The pods' network, measured: (1) DNS queries per second against dnsmasq (bench/_net_dns.py),
(2) adding one pod to a node whose 1,000 pods have rules, against a full load of the table.

Part (2) runs in a throwaway network namespace (feosbench-*, deleted at the end, also on
failure). The batch timed is the one feosd sends when a pod comes: its chains, its map elements
and its groups' new members, in one transaction (docs/network-table.md); beside it the full
replace of the 1,000 pods' table, which feosd sends at its start and every minute.

Run as root: .venv/bin/python bench/net.py. The last lines are the `ratio ...` lines.
"""

from __future__ import annotations

import ipaddress as ip
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from feos.net._groups import GroupPeer, Ports, Protocol, Rule, SecurityGroup, parse_block
from feos.net._nft import NodeFacts, PodNet, Table, compile_table, plan, render_full
from feos.net._table import NftLoader, TableWriter

PODS = 1000
ROUNDS = 7
FACTS = NodeFacts(
    ip.IPv6Network("2001:db8:1::/64"),
    deny_prefixes=(ip.ip_network("203.0.113.0/24"),),
    node_addresses=(ip.ip_address("192.0.2.1"), ip.ip_address("2001:db8:ffff::1")),
)


def groups() -> dict[str, SecurityGroup]:
    """20 groups of 6 rules: each lets its neighbour in, reaches blocks of both families."""
    out = {}
    for g in range(20):
        out[f"g{g}"] = SecurityGroup(
            f"g{g}",
            rules_in=(
                Rule(Protocol.TCP, GroupPeer(f"g{(g + 1) % 20}"), Ports(8000 + g, 8000 + g)),
                Rule(Protocol.ICMPV6, parse_block("2001:db8::/32", [f"2001:db8:{g:x}::/48"])),
                Rule(Protocol.UDP, parse_block("::/0", []), Ports(5000, 5100)),
            ),
            rules_out=(
                Rule(Protocol.TCP, GroupPeer(f"g{(g + 19) % 20}"), Ports(8000, 8020)),
                Rule(Protocol.TCP, parse_block("0.0.0.0/0", [f"10.{g}.0.0/16"]), Ports(443, 443)),
                Rule(Protocol.ANY, parse_block(f"198.51.{g}.0/24", [])),
            ),
        )
    return out


def pod(n: int) -> PodNet:
    named = () if n % 10 == 0 else (f"g{n % 20}", f"g{(n * 7) % 20}")
    return PodNet(
        f"pod-{n:08x}",
        ip.IPv6Address(int(FACTS.pod_prefix.network_address) + n + 2),
        ip.IPv4Address(int(FACTS.ipv4_range.network_address) + n + 1),
        tuple(dict.fromkeys(named)),
    )


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def measure(netns: str) -> tuple[float, float, Table, Table]:
    loader = NftLoader(netns)
    writer = TableWriter(loader)
    gs = groups()
    base = compile_table([pod(n) for n in range(PODS)], gs, FACTS)
    more = compile_table([pod(n) for n in range(PODS + 1)], gs, FACTS)
    full, added = [], []
    try:
        for _ in range(ROUNDS):
            full.append(await timed(lambda: writer.write(base, full=True)))
            added.append(await timed(lambda: writer.write(more)))
            assert writer.loaded is more
    finally:
        loader.close()
    return statistics.median(full), statistics.median(added), base, more


def nft_f_seconds(netns: str, script: str) -> float:
    """The same full load by `ip netns exec NS nft -f -`, the way the loader does not take."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=script, text=True,
                       check=True, capture_output=True)  # fmt: skip
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table_part() -> tuple[list[str], list[str]]:
    netns = f"feosbench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        full, added, base, more = trio.run(measure, netns)
        by_nft_f = nft_f_seconds(netns, render_full(base))
    finally:
        subprocess.run(["ip", "netns", "delete", netns], check=False)
    change = plan(base, more)
    chains = sum(len(c.rules) for c in base.chains)
    lines = [
        f"table of {PODS} pods: {len(base.chains)} chains, {chains} rules, {len(base.sets)} sets",
        f"full load of {PODS} pods (libnftables, one transaction): {full * 1000:.1f} ms",
        f"full load of {PODS} pods by ip netns exec nft -f -: {by_nft_f * 1000:.1f} ms",
        f"one pod added ({change.kind}, {len(change.script.splitlines())} commands): "
        f"{added * 1000:.2f} ms",
    ]
    return lines, [f"ratio one pod added / full load of {PODS}: {added / full:.4f} (target < 0.05)"]


def dns_part() -> tuple[list[str], list[str]]:
    here = Path(__file__).resolve().parent
    if not (here / "_net_dns.py").exists():
        return ["DNS: bench/_net_dns.py is missing: no DNS figure"], []
    sys.path.insert(0, str(here))
    from _net_dns import run  # type: ignore[import-not-found]

    printed: list[str] = run()
    return [x for x in printed if not x.startswith("ratio")], [
        x for x in printed if x.startswith("ratio")
    ]


def main() -> None:
    dns_lines, dns_ratios = dns_part()
    table_lines, table_ratios = table_part()
    for line in [*dns_lines, *table_lines, *dns_ratios, *table_ratios]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
