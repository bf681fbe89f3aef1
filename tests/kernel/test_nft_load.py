"""Whatever the groups and pods, the table loads, and a delta leaves what a full load does."""

from __future__ import annotations

import ipaddress as ip
import secrets
from collections.abc import Iterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run
from feos.net._groups import GroupPeer, Ports, Protocol, Rule, SecurityGroup, parse_block
from feos.net._nft import NodeFacts, PodNet, compile_table
from feos.net._table import NftLoader, TableWriter, loaded_rules, loaded_sets

KINDS: list[str] = []
IDS = ["a", "b", "web", "22222222-3333-4444-5555-666666666666"]
BLOCKS = ["0.0.0.0/0", "10.0.0.0/8", "198.51.100.7/32", "::/0", "2001:db8::/32", "fd00::/8"]


@st.composite
def rules(draw: st.DrawFn) -> Rule:
    if draw(st.booleans()):
        proto = draw(st.sampled_from([Protocol.ANY, Protocol.TCP, Protocol.UDP, Protocol.ICMPV6]))
        peer: GroupPeer | object = GroupPeer(draw(st.sampled_from(IDS)))
    else:
        cidr = draw(st.sampled_from(BLOCKS))
        net = ip.ip_network(cidr)
        icmp = Protocol.ICMP if net.version == 4 else Protocol.ICMPV6
        proto = draw(st.sampled_from([Protocol.ANY, Protocol.TCP, Protocol.UDP, icmp]))
        small = net.prefixlen >= net.max_prefixlen - 4
        excepts = [] if small or draw(st.booleans()) else [str(next(net.subnets(3)))]
        peer = parse_block(cidr, excepts)
    ports = None
    if proto in (Protocol.TCP, Protocol.UDP) and draw(st.booleans()):
        first = draw(st.integers(1, 65535))
        ports = Ports(first, draw(st.integers(first, 65535)))
    return Rule(proto, peer, ports)  # type: ignore[arg-type]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[PodNet], dict[str, SecurityGroup], NodeFacts]:
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=3))
    groups = {
        g: SecurityGroup(
            g,
            tuple(draw(st.lists(rules(), max_size=3))),
            tuple(draw(st.lists(rules(), max_size=3))),
        )
        for g in ids
    }
    names = st.lists(st.sampled_from(ids), unique=True, max_size=2) if ids else st.just([])
    pods = [
        PodNet(
            f"pod-{n:08x}",
            ip.IPv6Address(f"fd12:3456::{n + 2:x}"),
            ip.IPv4Address(f"169.254.16.{n + 2}"),
            tuple(draw(names)),
            draw(st.booleans()),
        )
        for n in draw(st.lists(st.integers(0, 7), unique=True, max_size=5))
    ]
    node = draw(
        st.lists(st.sampled_from(["192.0.2.1", "192.0.2.2", "2001:db8:ffff::1"]), unique=True)
    )
    deny = draw(
        st.lists(
            st.sampled_from(["203.0.113.0/24", "10.0.0.0/8", "2001:db8:dead::/48"]), unique=True
        )
    )
    facts = NodeFacts(
        ip.IPv6Network("fd12:3456::/64"),
        node_addresses=tuple(ip.ip_address(a) for a in node),
        deny_prefixes=tuple(ip.ip_network(d) for d in deny),
    )
    return pods, groups, facts


@pytest.fixture(scope="module")
def writer() -> Iterator[TableWriter]:
    """One namespace for every example: each loads over what the one before left."""
    name = f"feostest-nftload-{secrets.token_hex(3)}"
    run("ip", "netns", "add", name)
    loader = NftLoader(name)
    try:
        yield TableWriter(loader)
    finally:
        loader.close()
        run("ip", "netns", "delete", name, check=False)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(world=worlds())
def test_every_table_loads_and_deltas_match_full_loads(
    writer: TableWriter, world: tuple[list[PodNet], dict[str, SecurityGroup], NodeFacts]
) -> None:
    table = compile_table(*world)

    async def check() -> None:
        KINDS.append(await writer.write(table))  # a delta from the example before, where one does
        by_change = await writer.loader.read()
        await writer.write(table, full=True)
        by_full = await writer.loader.read()
        assert loaded_sets(by_change) == loaded_sets(by_full)
        assert loaded_rules(by_change) == loaded_rules(by_full)
        assert set(loaded_sets(by_full)) == {s.name for s in table.sets}
        assert set(loaded_rules(by_full)) == {c.name for c in table.chains}
        for chain in table.chains:
            assert len(loaded_rules(by_full)[chain.name]) == len(chain.rules)

    trio.run(check)


def test_the_examples_took_deltas() -> None:
    """The examples above moved the table by each kind of change, not only by full loads."""
    assert {"chains", "full"} <= set(KINDS)
