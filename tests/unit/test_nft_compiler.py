"""The compiler of table inet feos: its exact structure, its determinism, and its change plans."""

from __future__ import annotations

import ipaddress as ip
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net._groups import GroupPeer, Ports, Protocol, Rule, SecurityGroup, parse_block
from feos.net._nft import (
    REASONS,
    NodeFacts,
    PodNet,
    Table,
    block_set_name,
    change_kind,
    compile_table,
    element_delta,
    log_prefix,
    parse_log_prefix,
    plan,
    render_full,
)

FACTS = NodeFacts(
    ip.IPv6Network("fd12:3456::/64"),
    deny_prefixes=(ip.ip_network("203.0.113.0/24"), ip.ip_network("2001:db8:dead::/48")),
    node_addresses=(ip.ip_address("192.0.2.1"), ip.ip_address("2001:db8:ffff::1")),
)
WEB = SecurityGroup(
    "web",
    rules_in=(
        Rule(Protocol.TCP, GroupPeer("client"), Ports(8080, 8080)),
        Rule(Protocol.ANY, parse_block("10.0.0.0/8", [])),  # IPv4: ignored in
        Rule(Protocol.ICMPV6, parse_block("2001:db8::/32", ["2001:db8:1::/48"])),
    ),
    rules_out=(Rule(Protocol.UDP, parse_block("192.0.2.0/24", []), Ports(53, 54)),),
)
CLIENT = SecurityGroup(
    "client", rules_out=(Rule(Protocol.TCP, GroupPeer("web"), Ports(8080, 8080)),)
)
GROUPS = {"web": WEB, "client": CLIENT}


def pod(n: int, *groups: str, metadata: bool = False) -> PodNet:
    return PodNet(
        f"pod-{n:08x}",
        ip.IPv6Address(f"fd12:3456::{n + 1:x}"),
        ip.IPv4Address(f"169.254.16.{n + 1}"),
        groups,
        metadata,
    )


PODS = [pod(1, "web"), pod(2, "client"), pod(3)]


def table(pods: list[PodNet] = PODS, facts: NodeFacts = FACTS) -> Table:
    return compile_table(pods, GROUPS, facts)


def test_chains_are_the_spec_s() -> None:
    chains = table().chain_map()
    assert list(chains) == [
        "prerouting", "input", "forward", "postrouting", "nat-prerouting", "nat-output",
        "from-pods", "to-pods", "publish", "out-pod-00000001", "in-pod-00000001", "out-pod-00000002", "in-pod-00000002",
        "out-pod-00000003", "in-pod-00000003",
    ]  # fmt: skip
    assert chains["prerouting"].hook == "type filter hook prerouting priority -150; policy accept;"
    assert chains["postrouting"].hook == "type nat hook postrouting priority 100; policy accept;"
    assert chains["postrouting"].rules == (
        'ip saddr 169.254.16.0/20 oifname != "pod-*" masquerade',
        'oifname "pod-*" ip saddr 127.0.0.0/8 masquerade',
        'oifname "pod-*" ct status dnat ip6 saddr != fc00::/7 snat ip6 to fd12:3456::1',
        'oifname "pod-*" fib saddr type local ip6 saddr != fc00::/7 snat ip6 to fd12:3456::1',
    )
    assert chains["from-pods"].hook is None
    assert chains["out-pod-00000001"].hook is None


def test_prerouting_drops_spoofed_and_router_messages() -> None:
    rules = table().chain_map()["prerouting"].rules
    assert 'iifname "pod-*" fib saddr . iif oif missing counter drop' in rules
    assert any("nd-router-advert, nd-redirect" in r and r.endswith("drop") for r in rules)
    assert any("router-advertisement, redirect" in r and r.endswith("drop") for r in rules)
    assert sum('log prefix "feos:spoofed" group 2' in r for r in rules) == 1


def test_input_takes_nd_dns_and_otlp_and_drops_the_rest() -> None:
    rules = table().chain_map()["input"].rules
    assert rules[:4] == (
        'iifname "pod-*" icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept',
        'iifname "pod-*" ip daddr 169.254.0.53 udp dport 53 accept',
        'iifname "pod-*" ip daddr 169.254.0.53 tcp dport 53 accept',
        'iifname "pod-*" ip daddr 169.254.169.1 tcp dport { 4317, 4318 } accept',
    )
    assert rules[-1] == 'iifname "pod-*" counter drop'


def test_forward_order() -> None:
    rules = table().chain_map()["forward"].rules
    assert rules[0] == (
        'iifname "pod-*" meta l4proto tcp ct direction original ct original packets < 5 log group 3'
    )
    assert rules[1] == "ct state established,related accept"
    assert rules[-2:] == ('iifname "pod-*" jump from-pods', 'oifname "pod-*" jump to-pods')


def test_vmaps_go_to_the_pods_chains() -> None:
    sets = table().set_map()
    assert sets["pod-out"].is_map
    assert sets["pod-out"].decl == "type ifname : verdict;"
    assert sets["pod-out"].elements == tuple(
        f'"pod-0000000{n}" : goto out-pod-0000000{n}' for n in (1, 2, 3)
    )
    assert sets["pod-in"].elements[0] == '"pod-00000001" : goto in-pod-00000001'
    chains = table().chain_map()
    assert chains["from-pods"].rules[0] == "iifname vmap @pod-out"
    assert chains["to-pods"].rules[0] == "oifname vmap @pod-in"
    assert chains["from-pods"].rules[-1] == "counter drop"


def test_pod_chains() -> None:
    chains = table().chain_map()
    b4 = block_set_name(WEB.rules_out[0].peer)  # type: ignore[arg-type]
    b6 = block_set_name(WEB.rules_in[2].peer)  # type: ignore[arg-type]
    out = chains["out-pod-00000001"].rules
    assert out[1] == "ip daddr @deny4 counter drop"
    assert out[3] == "ip6 daddr @deny6 counter drop"
    assert out[4:-2] == (f"ip daddr @{b4} udp dport 53-54 return",)
    assert 'log prefix "feos:no-rule:pod-00000001" group 2' in out[-2]
    assert chains["in-pod-00000001"].rules[2:-2] == (
        "ip6 saddr @g-client tcp dport 8080 return",
        f"ip6 saddr @{b6} meta l4proto ipv6-icmp return",
    )
    assert chains["out-pod-00000002"].rules[4:-2] == ("ip6 daddr @g-web tcp dport 8080 return",)
    # the default group: out to the internet, nothing in
    assert chains["out-pod-00000003"].rules[4:-2] == (
        "ip daddr @internet4 return",
        "ip6 daddr @internet6 return",
    )
    assert chains["in-pod-00000003"].rules[2:-2] == ()


def test_sets() -> None:
    sets = table().set_map()
    assert sets["deny4"].elements == (
        "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "192.0.2.1/32", "203.0.113.0/24",
        "224.0.0.0/4", "255.255.255.255/32",
    )  # fmt: skip
    assert sets["deny6"].elements == (
        "::/127",
        "2001:db8:dead::/48",
        "2001:db8:ffff::1/128",
        "fe80::/10",
        "ff00::/8",
    )
    assert sets["internet4"].elements == ("0.0.0.0/0",)
    assert sets["internet6"].elements == ("::/0",)
    assert sets["g-web"].elements == ("fd12:3456::2",)
    assert sets["g-client"].elements == ("fd12:3456::3",)
    b6 = sets[block_set_name(WEB.rules_in[2].peer)]  # type: ignore[arg-type]
    assert b6.decl == "type ipv6_addr; flags interval;"
    assert "2001:db8::/48" in b6.elements
    assert "2001:db8:1::/48" not in b6.elements
    assert len(b6.elements) == 16
    assert block_set_name(WEB.rules_in[1].peer) not in sets  # type: ignore[arg-type]
    assert {f"rl-{r}" for r in REASONS} <= sets.keys()


def test_deny_a_pods_range_not_in_the_link_local_block() -> None:
    facts = NodeFacts(FACTS.pod_prefix, ipv4_range=ip.IPv4Network("100.64.0.0/20"))
    assert "100.64.0.0/20" in table(facts=facts).set_map()["deny4"].elements


def test_metadata_of_the_node_for_its_qemu_pods() -> None:
    t = table([pod(1, metadata=True), pod(2)])
    assert t.set_map()["meta-local"].elements == ('"pod-00000001"',)
    rules = t.chain_map()["input"].rules
    assert rules[-4] == "iifname @meta-local ip daddr 169.254.169.254 tcp dport 80 accept"
    assert "169.254.0.0/16" in t.set_map()["deny4"].elements  # forwarded, it is denied


def test_a_missing_group_fails_the_pod() -> None:
    with pytest.raises(FeosError) as e:
        compile_table([pod(1, "web", "nope")], GROUPS, FACTS)
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "nope" in e.value.message
    assert "pod-00000001" in e.value.message


def test_bad_taps_refused() -> None:
    with pytest.raises(FeosError, match="tap"):
        compile_table([PodNet("eth0", ip.IPv6Address("fd12:3456::9"), None)], {}, FACTS)
    with pytest.raises(FeosError, match="twice"):
        compile_table([pod(1), pod(1)], {}, FACTS)


def test_full_script_is_flush_safe() -> None:
    lines = render_full(table()).splitlines()
    assert lines[:3] == ["table inet feos {}", "delete table inet feos", "table inet feos {"]
    assert lines[-1] == "}"


def test_log_prefixes() -> None:
    for reason in REASONS:
        assert parse_log_prefix(log_prefix(reason, "pod-1")) == (reason, "pod-1")
        assert parse_log_prefix(log_prefix(reason)) == (reason, None)
    assert parse_log_prefix("IN=eth0") is None
    assert parse_log_prefix("feos:other") is None


# ---- plans ---------------------------------------------------------------------------------


def test_plan_kinds() -> None:
    before = table()
    assert change_kind(None, before) == "full"
    assert change_kind(before, table()) == "none"
    assert plan(before, table()).script == ""
    assert change_kind(before, table([*PODS, pod(4, "web")])) == "chains"
    assert change_kind(before, table(PODS[:2])) == "chains"
    moved = NodeFacts(FACTS.pod_prefix, node_addresses=(ip.ip_address("192.0.2.7"),))
    assert change_kind(before, table(facts=moved)) == "elements"
    dns = NodeFacts(FACTS.pod_prefix, dns_address=ip.IPv4Address("169.254.0.54"))
    assert change_kind(before, table(facts=dns)) == "full"
    assert plan(before, table(facts=dns)).script == render_full(table(facts=dns))


def test_element_delta_of_node_addresses() -> None:
    moved = NodeFacts(
        FACTS.pod_prefix,
        deny_prefixes=FACTS.deny_prefixes,
        node_addresses=(ip.ip_address("192.0.2.9"), ip.ip_address("2001:db8:ffff::1")),
    )
    delta = element_delta(table(), table(facts=moved))
    assert delta == {"deny4": (("192.0.2.9/32",), ("192.0.2.1/32",))}
    change = plan(table(), table(facts=moved))
    assert change.script.splitlines() == [
        "delete element inet feos deny4 { 192.0.2.1/32 }",
        "add element inet feos deny4 { 192.0.2.9/32 }",
    ]


def test_adding_a_pod_touches_only_its_chains_maps_and_members() -> None:
    script = plan(table(), table([*PODS, pod(4, "web")])).script
    assert "delete table" not in script
    assert "flush" not in script
    assert "add chain inet feos out-pod-00000004" in script
    assert "add chain inet feos in-pod-00000004" in script
    assert 'add element inet feos pod-out { "pod-00000004" : goto out-pod-00000004 }' in script
    assert "add element inet feos g-web { fd12:3456::5 }" in script
    assert "prerouting" not in script


def test_removing_a_pod_deletes_map_elements_before_its_chains() -> None:
    lines = plan(table(), table(PODS[1:])).script.splitlines()
    element = lines.index(
        'delete element inet feos pod-out { "pod-00000001" : goto out-pod-00000001 }'
    )
    assert element < lines.index("delete chain inet feos out-pod-00000001")
    assert "delete set inet feos " + block_set_name(WEB.rules_out[0].peer) in lines  # type: ignore[arg-type]


def test_a_changed_group_refills_only_its_pods_chains() -> None:
    groups = {**GROUPS, "client": SecurityGroup("client")}
    script = plan(table(), compile_table(PODS, groups, FACTS)).script
    assert "flush chain inet feos out-pod-00000002" in script
    assert "out-pod-00000001" not in script
    assert "out-pod-00000003" not in script


# ---- random worlds -------------------------------------------------------------------------

ids = st.sampled_from(["a", "b", "c", "web", "22222222-3333-4444-5555-666666666666"])
v4 = st.sampled_from(["0.0.0.0/0", "10.0.0.0/8", "192.0.2.0/24", "198.51.100.7/32"])
v6 = st.sampled_from(["::/0", "2001:db8::/32", "2001:db8:1::/48", "fd00::/8"])


@st.composite
def rules(draw: st.DrawFn) -> Rule:
    kind = draw(st.sampled_from(["any4", "any6", "tcp", "udp", "icmp", "icmpv6", "group"]))
    if kind == "group":
        return Rule(
            draw(st.sampled_from([Protocol.ANY, Protocol.TCP, Protocol.ICMPV6])),
            GroupPeer(draw(ids)),
        )
    if kind in ("icmp", "any4"):
        cidr = draw(v4)
        proto = Protocol.ICMP if kind == "icmp" else Protocol.ANY
    else:
        cidr = draw(v6 if kind in ("any6", "icmpv6") else st.one_of(v4, v6))
        proto = {
            "any6": Protocol.ANY,
            "icmpv6": Protocol.ICMPV6,
            "tcp": Protocol.TCP,
            "udp": Protocol.UDP,
        }[kind]
    net = ip.ip_network(cidr)
    excepts = [] if net.prefixlen >= net.max_prefixlen - 4 else [str(next(net.subnets(4)))]
    ports = None
    if proto in (Protocol.TCP, Protocol.UDP) and draw(st.booleans()):
        first = draw(st.integers(1, 65535))
        ports = Ports(first, draw(st.integers(first, 65535)))
    return Rule(proto, parse_block(cidr, excepts), ports)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[PodNet], dict[str, SecurityGroup]]:
    group_ids = draw(st.lists(ids, unique=True, max_size=4))
    groups = {
        g: SecurityGroup(
            g,
            tuple(draw(st.lists(rules(), max_size=4))),
            tuple(draw(st.lists(rules(), max_size=4))),
        )
        for g in group_ids
    }
    count = draw(st.integers(0, 6))
    names = (
        st.lists(st.sampled_from(group_ids), unique=True, max_size=3) if group_ids else st.just([])
    )
    pods = [pod(n, *draw(names), metadata=draw(st.booleans())) for n in range(count)]
    return pods, groups


@settings(max_examples=60, deadline=None)
@given(worlds(), st.randoms())
def test_deterministic(
    world: tuple[list[PodNet], dict[str, SecurityGroup]], rnd: random.Random
) -> None:
    pods, groups = world
    shuffled = list(pods)
    rnd.shuffle(shuffled)
    reordered = dict(sorted(groups.items(), reverse=True))
    assert render_full(compile_table(pods, groups, FACTS)) == render_full(
        compile_table(shuffled, reordered, FACTS)
    )


@settings(max_examples=60, deadline=None)
@given(worlds(), worlds())
def test_plans_between_worlds(
    a: tuple[list[PodNet], dict[str, SecurityGroup]],
    b: tuple[list[PodNet], dict[str, SecurityGroup]],
) -> None:
    old, new = compile_table(*a, FACTS), compile_table(*b, FACTS)
    change = plan(old, new)
    assert change.kind in ("none", "chains", "elements", "full")
    assert (change.kind == "none") == (old == new)
    if change.kind != "full":
        assert "delete table" not in change.script
