"""The compiler of the pods' table, `inet feos`: pods, groups and the node's facts in, nft text out.

Theory of operation. `compile_table` builds a Table, a plain value: its sets and maps and its
chains, each chain a tuple of rule texts, all in a fixed order, so the same input gives the same
table, byte for byte. `render_full` writes it as one nft script that replaces the table in one
transaction (`table inet feos {}` makes `delete` safe on a node without it). `plan(old, new)`
compares the table loaded last with the new one and says what the change needs:

  none      nothing differs;
  elements  only elements of sets differ (members of groups, the node's addresses, the denied
            prefixes): one batch of `add element` / `delete element`;
  chains    the pods' chains, the maps pod-out and pod-in, or the g- and b- sets differ (pods
            come or go, rules change): one batch that adds, flushes and refills, or deletes what
            differs and leaves the rest. What it leaves loaded is what a full replace would load;
  full      a base chain or a set's declaration differs: the whole table again.

Drops are logged to nflog group 2 at most 10 a second per pod and reason: a dynamic set per
reason (rl-<reason>), keyed by the pod's TAP, holds a limiter per pod, so the limit holds across
the rules and chains that log the same reason. The prefix is `feos:<reason>:<TAP>` where the
chain is the pod's, else `feos:<reason>` and the nflog record's interface names the TAP.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from feos.errors import Code, FeosError, invalid

from ._contract import PublishedPort
from ._groups import Block, GroupPeer, Network, Protocol, Rule, SecurityGroup, block_remainder

TABLE = "inet feos"
LOG_GROUP_DROPS = 2
LOG_GROUP_FIRST_PACKETS = 3
METADATA_ADDRESS = ipaddress.IPv4Address("169.254.169.254")
DEFAULT_IPV4_RANGE = ipaddress.IPv4Network("169.254.16.0/20")
DEFAULT_DNS_ADDRESS = ipaddress.IPv4Address("169.254.0.53")
DEFAULT_OTLP_ADDRESS = ipaddress.IPv4Address("169.254.169.1")
REASONS = ("spoofed", "router", "input", "invalid", "deny", "no-rule")

_TAP = re.compile(r"pod-[A-Za-z0-9_.-]{1,11}\Z")
_DENY4_ALWAYS = tuple(
    ipaddress.IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32")
)
_DENY6_ALWAYS = tuple(
    ipaddress.IPv6Network(n) for n in ("::/128", "::1/128", "fe80::/10", "ff00::/8")
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@attrs.frozen
class PodNet:
    """A pod as the table sees it. Its IPv4 address is not in the table: its route pins it."""

    tap: str
    ipv6: ipaddress.IPv6Address
    ipv4: ipaddress.IPv4Address | None
    groups: tuple[str, ...] = ()
    local_metadata: bool = False
    """The node serves its metadata (QEMU pods); Firecracker's MMDS answers in the microVM."""
    published: tuple[PublishedPort, ...] = ()
    """The node's ports forwarded to the pod (DNAT in the chain publish, admitted in in-)."""


@attrs.frozen
class NodeFacts:
    pod_prefix: ipaddress.IPv6Network
    ipv4_range: ipaddress.IPv4Network = DEFAULT_IPV4_RANGE
    dns_address: ipaddress.IPv4Address = DEFAULT_DNS_ADDRESS
    otlp_address: ipaddress.IPv4Address = DEFAULT_OTLP_ADDRESS
    deny_prefixes: tuple[Network, ...] = ()
    node_addresses: tuple[IPAddress, ...] = ()
    mesh_endpoints: tuple[IPAddress, ...] = ()
    mesh_prefix: ipaddress.IPv6Network | None = None
    """The cluster's ULA on a mesh: a source in it must come through the device routed to it."""
    metadata_port: int = 80
    """The node's own metadata service's port at 169.254.169.254, for pods with local_metadata."""


@attrs.frozen
class NftSet:
    name: str
    decl: str
    """What follows the name in braces, without elements: `type ipv4_addr; flags interval;`."""
    elements: tuple[str, ...] = ()
    is_map: bool = False


@attrs.frozen
class Chain:
    name: str
    rules: tuple[str, ...]
    hook: str | None = None
    """`type filter hook forward priority filter; policy accept;` for a base chain."""


@attrs.frozen
class Table:
    sets: tuple[NftSet, ...]
    chains: tuple[Chain, ...]

    def set_map(self) -> dict[str, NftSet]:
        return {s.name: s for s in self.sets}

    def chain_map(self) -> dict[str, Chain]:
        return {c.name: c for c in self.chains}


Kind = Literal["none", "elements", "chains", "full"]


@attrs.frozen
class Change:
    kind: Kind
    script: str


def log_prefix(reason: str, tap: str | None = None) -> str:
    return f"feos:{reason}:{tap}" if tap else f"feos:{reason}"


def parse_log_prefix(prefix: str) -> tuple[str, str | None] | None:
    """(reason, TAP or None) of one of the table's prefixes; None for another's."""
    parts = prefix.strip().split(":")
    if len(parts) not in (2, 3) or parts[0] != "feos" or parts[1] not in REASONS:
        return None
    return parts[1], (parts[2] if len(parts) == 3 else None)


def block_set_name(block: Block) -> str:
    """b-<hash>: the hash of the block and its excepts, in a canonical order."""
    text = " ".join([str(block.cidr), *sorted(str(e) for e in block.excepts)])
    return "b-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def group_set_name(group_id: str) -> str:
    return f"g-{group_id}"


# ---- compile -------------------------------------------------------------------------------


def compile_table(
    pods: Sequence[PodNet], groups: Mapping[str, SecurityGroup], facts: NodeFacts
) -> Table:
    """The whole table. A pod naming a group that is not in `groups` is FAILED_PRECONDITION."""
    pods = sorted(pods, key=lambda p: p.tap)
    _check_pods(pods, groups)
    chains = [*_base_chains(facts), *_dispatch_chains(), Chain("publish", _publish(pods))]
    for pod in pods:
        chains += _pod_chains(pod, groups)
    return Table(_sets(pods, groups, facts), tuple(chains))


def _check_pods(pods: Sequence[PodNet], groups: Mapping[str, SecurityGroup]) -> None:
    seen: set[str] = set()
    for pod in pods:
        if not _TAP.match(pod.tap):
            raise invalid("tap", f"{pod.tap!r} is not pod-<1 to 11 of A-Z a-z 0-9 _ . ->")
        if pod.tap in seen:
            raise invalid("tap", f"{pod.tap} is named twice")
        seen.add(pod.tap)
        missing = [g for g in pod.groups if g not in groups]
        if missing:
            raise FeosError(
                Code.FAILED_PRECONDITION,
                f"{pod.tap}: the node does not have the security groups {', '.join(missing)}",
            )


def _drop(match: str, reason: str, key: str, tap: str | None = None) -> list[str]:
    """Log (rate-limited per TAP and reason) and drop what `match` matches."""
    m = f"{match} " if match else ""
    return [
        f"{m}update @rl-{reason} {{ {key} limit rate 10/second }} "
        f'log prefix "{log_prefix(reason, tap)}" group {LOG_GROUP_DROPS}',
        f"{m}counter drop",
    ]


_PODS_IN = 'iifname "pod-*"'
_PODS_OUT = 'oifname "pod-*"'


def _base_chains(facts: NodeFacts) -> list[Chain]:
    return [
        Chain("prerouting", tuple(_prerouting(facts)), _hook("filter", "prerouting", "-150")),
        Chain("input", tuple(_input(facts)), _hook("filter", "input", "0")),
        Chain("forward", tuple(_forward()), _hook("filter", "forward", "0")),
        Chain("postrouting", tuple(_postrouting(facts)), _hook("nat", "postrouting", "100")),
        Chain("nat-prerouting", _NAT_PREROUTING, _hook("nat", "prerouting", "-100")),
        Chain("nat-output", _NAT_OUTPUT, _hook("nat", "output", "-100")),
    ]


# Published ports (docs/network.md): what comes to one of the node's own addresses, from outside
# the pods or from the node itself, goes through the chain publish, which DNATs a published port
# to its pod. Link-local addresses (the resolver, OTLP, metadata, fe80::1) are never published;
# ::1 from the node is left to feosd's relay (the kernel does not route ::1 out of a device).
_NOT_LINK_LOCAL = ("ip daddr 169.254.0.0/16 return", "ip6 daddr fe80::/10 return")
_NAT_PREROUTING = (f"{_PODS_IN} return", *_NOT_LINK_LOCAL, "fib daddr type local jump publish")
_NAT_OUTPUT = ("ip6 daddr ::1 return", *_NOT_LINK_LOCAL, "fib daddr type local jump publish")


def _hook(kind: str, hook: str, priority: str) -> str:
    return f"type {kind} hook {hook} priority {priority}; policy accept;"


def _prerouting(facts: NodeFacts) -> list[str]:
    rules = [
        *_drop(f"{_PODS_IN} fib saddr . iif oif missing", "spoofed", "iifname"),
        *_drop(f"{_PODS_IN} icmpv6 type {{ nd-router-advert, nd-redirect }}", "router", "iifname"),
        *_drop(f"{_PODS_IN} icmp type {{ router-advertisement, redirect }}", "router", "iifname"),
    ]
    if facts.mesh_prefix is not None:
        match = f"ip6 saddr {facts.mesh_prefix} fib saddr . iif oif missing"
        rules += _drop(match, "spoofed", "iifname")
    return rules


def _input(facts: NodeFacts) -> list[str]:
    dns, otlp = facts.dns_address, facts.otlp_address
    rules = [
        f"{_PODS_IN} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept",
        f"{_PODS_IN} ip daddr {dns} udp dport 53 accept",
        f"{_PODS_IN} ip daddr {dns} tcp dport 53 accept",
        f"{_PODS_IN} ip daddr {otlp} tcp dport {{ 4317, 4318 }} accept",
    ]
    # QEMU pods: the node answers 169.254.169.254 on their own TAP (a policy route makes it
    # local for that TAP alone); every other pod's packet to it is dropped here or in forward
    rules.append(
        f"iifname @meta-local ip daddr {METADATA_ADDRESS} tcp dport {facts.metadata_port} accept"
    )
    # replies to connections the node opened to a pod (a published port reached from the node,
    # feosd's ::1 relay); a pod cannot make a conntrack entry whose reply direction is its own
    rules.append(f"{_PODS_IN} ct direction reply ct state established accept")
    return [*rules, *_drop(_PODS_IN, "input", "iifname")]


def _forward() -> list[str]:
    return [
        f"{_PODS_IN} meta l4proto tcp ct direction original ct original packets < 5 "
        f"log group {LOG_GROUP_FIRST_PACKETS}",
        "ct state established,related accept",
        *_drop(f"{_PODS_IN} ct state invalid", "invalid", "iifname"),
        *_drop(f"{_PODS_OUT} ct state invalid", "invalid", "oifname"),
        f"{_PODS_IN} jump from-pods",
        f"{_PODS_OUT} jump to-pods",
    ]


def _postrouting(facts: NodeFacts) -> list[str]:
    return [
        f'ip saddr {facts.ipv4_range} oifname != "pod-*" masquerade',
        # 127.0.0.1 DNATed to a pod (route_localnet on its TAP): the pod sees the TAP's address
        f"{_PODS_OUT} ip saddr 127.0.0.0/8 masquerade",
        *_ula_snat(facts.pod_prefix),
    ]


_ULA = ipaddress.IPv6Network("fc00::/7")


def _ula_snat(prefix: ipaddress.IPv6Network) -> list[str]:
    """Pods of a ULA prefix route only fc00::/7 back: what reaches them through a publish (or
    the node's relay) from another IPv6 source comes from the prefix's ::1, which no pod holds
    (the counter starts at ::2), so their answers come back to the node to be un-NATed."""
    if not prefix.subnet_of(_ULA):
        return []
    source = f"ip6 saddr != {_ULA} snat ip6 to {prefix[1]}"
    return [f"{_PODS_OUT} ct status dnat {source}",
            f"{_PODS_OUT} fib saddr type local {source}"]


def _publish(pods: Sequence[PodNet]) -> tuple[str, ...]:
    return tuple(r for pod in pods for port in pod.published for r in _dnat(pod, port))


def _dnat(pod: PodNet, port: PublishedPort) -> list[str]:
    """The DNAT rules of one publish: each family the host address covers that the pod has."""
    match = f"{port.protocol} dport {port.host_port}"
    host = port.host_address
    addr = ipaddress.ip_address(host) if host else None
    rules = []
    if pod.ipv4 is not None and (addr is None or addr.version == 4):
        where = "meta nfproto ipv4" if addr is None or addr.is_unspecified else f"ip daddr {addr}"
        rules.append(f"{where} {match} dnat ip to {pod.ipv4}:{port.pod_port}")
    if addr is None or addr.version == 6:
        where = "meta nfproto ipv6" if addr is None or addr.is_unspecified else f"ip6 daddr {addr}"
        rules.append(f"{where} {match} dnat ip6 to [{pod.ipv6}]:{port.pod_port}")
    return rules


def _admit_published(pod: PodNet) -> list[str]:
    """In the pod's in- chain: a connection the DNAT made for one of its publishes (both
    families: IPv4 here is the documented extension of in- chains that are otherwise IPv6's)."""
    return _unique(
        f"{p.protocol} dport {p.pod_port} ct status dnat ct original proto-dst {p.host_port} return"
        for p in pod.published
    )


def _dispatch_chains() -> list[Chain]:
    return [
        Chain("from-pods", ("iifname vmap @pod-out", *_drop("", "no-rule", "iifname"))),
        Chain("to-pods", ("oifname vmap @pod-in", *_drop("", "no-rule", "oifname"))),
    ]


def _pod_chains(pod: PodNet, groups: Mapping[str, SecurityGroup]) -> list[Chain]:
    named = [groups[g] for g in pod.groups]
    if named:
        allow_out = [_allow(r, "out") for g in named for r in g.rules_out]
        allow_in = [_allow(r, "in") for g in named for r in g.rules_in]
    else:  # the default group: out to the internet, nothing in
        allow_out = ["ip daddr @internet4 return", "ip6 daddr @internet6 return"]
        allow_in = []
    out = [
        *_drop("ip daddr @deny4", "deny", "iifname", pod.tap),
        *_drop("ip6 daddr @deny6", "deny", "iifname", pod.tap),
        *_unique(allow_out),
        *_drop("", "no-rule", "iifname", pod.tap),
    ]
    in_ = [
        *_drop("ip6 saddr @deny6", "deny", "oifname", pod.tap),
        *_unique(allow_in),
        *_admit_published(pod),
        *_drop("", "no-rule", "oifname", pod.tap),
    ]
    return [Chain(f"out-{pod.tap}", tuple(out)), Chain(f"in-{pod.tap}", tuple(in_))]


def _unique(rules: Iterable[str | None]) -> list[str]:
    return list(dict.fromkeys(r for r in rules if r is not None))


def _allow(rule: Rule, direction: Literal["in", "out"]) -> str | None:
    """The rule as one nft rule ending in return; None where its direction cannot see it."""
    addr = "daddr" if direction == "out" else "saddr"
    peer = rule.peer
    if isinstance(peer, GroupPeer):
        family, name = "ip6", group_set_name(peer.group_id)
    else:
        family, name = ("ip" if peer.version == 4 else "ip6"), block_set_name(peer)
    if direction == "in" and (family == "ip" or rule.protocol == Protocol.ICMP):
        return None  # in- chains are of IPv6 alone
    return f"{family} {addr} @{name} {_protocol(rule)}return"


def _protocol(rule: Rule) -> str:
    if rule.protocol == Protocol.ANY:
        return ""
    if rule.protocol in (Protocol.ICMP, Protocol.ICMPV6):
        return "meta l4proto icmp " if rule.protocol == Protocol.ICMP else "meta l4proto ipv6-icmp "
    proto = "tcp" if rule.protocol == Protocol.TCP else "udp"
    if rule.ports is None:
        return f"meta l4proto {proto} "
    first, last = rule.ports.first, rule.ports.last
    return f"{proto} dport {first if first == last else f'{first}-{last}'} "


# ---- sets ----------------------------------------------------------------------------------


def _sets(
    pods: Sequence[PodNet], groups: Mapping[str, SecurityGroup], facts: NodeFacts
) -> tuple[NftSet, ...]:
    deny4, deny6 = _deny(facts)
    fixed = [
        _ip_set("deny4", 4, deny4),
        _ip_set("deny6", 6, deny6),
        _ip_set("internet4", 4, [ipaddress.IPv4Network("0.0.0.0/0")]),
        _ip_set("internet6", 6, [ipaddress.IPv6Network("::/0")]),
        NftSet("meta-local", "type ifname;", _quoted(p.tap for p in pods if p.local_metadata)),
        *(
            NftSet(f"rl-{r}", "type ifname; size 65535; flags dynamic,timeout; timeout 1m;")
            for r in REASONS
        ),
        _vmap("pod-out", [(p.tap, f"goto out-{p.tap}") for p in pods]),
        _vmap("pod-in", [(p.tap, f"goto in-{p.tap}") for p in pods]),
    ]
    return (*fixed, *_group_sets(pods, groups), *_block_sets(pods, groups))


def _deny(facts: NodeFacts) -> tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]]:
    nets: list[Network] = [
        *_DENY4_ALWAYS,
        *_DENY6_ALWAYS,
        facts.ipv4_range,
        *facts.deny_prefixes,
        *(ipaddress.ip_network(a) for a in (*facts.node_addresses, *facts.mesh_endpoints)),
    ]
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    return v4, v6


def _ip_set(name: str, version: int, nets: Iterable[Network]) -> NftSet:
    kind = "ipv4_addr" if version == 4 else "ipv6_addr"
    merged = ipaddress.collapse_addresses(nets)  # type: ignore[type-var]
    return NftSet(name, f"type {kind}; flags interval;", tuple(str(n) for n in merged))


def _quoted(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(f'"{n}"' for n in sorted(names))


def _vmap(name: str, entries: Iterable[tuple[str, str]]) -> NftSet:
    elements = tuple(f'"{k}" : {v}' for k, v in sorted(entries))
    return NftSet(name, "type ifname : verdict;", elements, is_map=True)


def _group_sets(pods: Sequence[PodNet], groups: Mapping[str, SecurityGroup]) -> list[NftSet]:
    """g-<id> for every group the node has and every group a rule names."""
    ids = set(groups)
    for group in groups.values():
        for rule in (*group.rules_in, *group.rules_out):
            if isinstance(rule.peer, GroupPeer):
                ids.add(rule.peer.group_id)
    members: dict[str, list[ipaddress.IPv6Address]] = {g: [] for g in ids}
    for pod in pods:
        for g in pod.groups:
            members[g].append(pod.ipv6)
    return [
        NftSet(group_set_name(g), "type ipv6_addr;", tuple(str(a) for a in sorted(set(members[g]))))
        for g in sorted(ids)
    ]


def _block_sets(pods: Sequence[PodNet], groups: Mapping[str, SecurityGroup]) -> list[NftSet]:
    """b-<hash> for every block a rule of a pod's group uses, IPv4 blocks of rules in aside."""
    used = {g for p in pods for g in p.groups}
    blocks: dict[str, Block] = {}
    for gid in sorted(used):
        group = groups[gid]
        for rule, direction in [(r, "out") for r in group.rules_out] + [
            (r, "in") for r in group.rules_in
        ]:
            if isinstance(rule.peer, Block) and _allow(rule, direction) is not None:  # type: ignore[arg-type]
                blocks[block_set_name(rule.peer)] = rule.peer
    return [_ip_set(n, b.version, block_remainder(b)) for n, b in sorted(blocks.items())]


# ---- render --------------------------------------------------------------------------------


def render_full(table: Table) -> str:
    """One script that replaces the table whole, in one transaction."""
    lines = [f"table {TABLE} {{}}", f"delete table {TABLE}", f"table {TABLE} {{"]
    for s in table.sets:
        kind = "map" if s.is_map else "set"
        elements = f" elements = {{ {', '.join(s.elements)} }}" if s.elements else ""
        lines.append(f"  {kind} {s.name} {{ {s.decl}{elements} }}")
    for c in table.chains:
        lines.append(f"  chain {c.name} {{")
        if c.hook:
            lines.append(f"    {c.hook}")
        lines += [f"    {r}" for r in c.rules]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def element_delta(old: Table, new: Table) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per set or map in both tables whose elements differ: (added, removed), each in order."""
    olds, delta = old.set_map(), {}
    for s in new.sets:
        if s.name in olds and olds[s.name].elements != s.elements:
            before, after = set(olds[s.name].elements), set(s.elements)
            added = tuple(e for e in s.elements if e not in before)
            removed = tuple(e for e in olds[s.name].elements if e not in after)
            delta[s.name] = (added, removed)
    return delta


def change_kind(old: Table | None, new: Table) -> Kind:
    """What moving the loaded table `old` to `new` needs (see the module's docstring)."""
    if old is None:
        return "full"
    if old == new:
        return "none"
    olds, news = old.set_map(), new.set_map()
    if any(olds[n].decl != s.decl for n, s in news.items() if n in olds):
        return "full"
    base_old = [c for c in old.chains if c.hook]
    base_new = [c for c in new.chains if c.hook]
    if base_old != base_new:
        return "full"
    maps_same = all(olds.get(n) == s for n, s in news.items() if s.is_map)
    if old.chains == new.chains and olds.keys() == news.keys() and maps_same:
        return "elements"
    return "chains"


def needs_full_replace(old: Table | None, new: Table) -> bool:
    return change_kind(old, new) == "full"


def plan(old: Table | None, new: Table) -> Change:
    kind = change_kind(old, new)
    if kind == "full" or old is None:
        return Change("full", render_full(new))
    if kind == "none":
        return Change("none", "")
    return Change(kind, render_delta(old, new))


def render_delta(old: Table, new: Table) -> str:
    """One batch moving `old` to `new` for a change that keeps the base chains and declarations.

    Order matters within the batch: what a rule or map element refers to exists before it, and
    what goes is no longer referred to when it is deleted.
    """
    olds, news = old.set_map(), new.set_map()
    oldc, newc = old.chain_map(), new.chain_map()
    delta = element_delta(old, new)
    added = [s for s in new.sets if s.name not in olds]
    lines = [f"add {_kind(s)} {TABLE} {s.name} {{ {s.decl} }}" for s in added]
    for c in new.chains:
        if c.name not in oldc:
            lines.append(f"add chain {TABLE} {c.name}")
            lines += [f"add rule {TABLE} {c.name} {r}" for r in c.rules]
    # deletes before adds: an interval set refuses a prefix that overlaps one still in it
    lines += _elements("delete", {n: r for n, (_, r) in delta.items()})
    lines += _elements("add", {n: s.elements for n, s in news.items() if n not in olds})
    lines += _elements("add", {n: a for n, (a, _) in delta.items()})
    for c in new.chains:
        if c.name in oldc and oldc[c.name] != c:
            lines.append(f"flush chain {TABLE} {c.name}")
            lines += [f"add rule {TABLE} {c.name} {r}" for r in c.rules]
    lines += [f"delete chain {TABLE} {c.name}" for c in old.chains if c.name not in newc]
    lines += [f"delete {_kind(s)} {TABLE} {s.name}" for s in old.sets if s.name not in news]
    return "\n".join(lines) + "\n" if lines else ""


def _kind(s: NftSet) -> str:
    return "map" if s.is_map else "set"


def _elements(verb: str, per_set: Mapping[str, Sequence[str]]) -> list[str]:
    return [
        f"{verb} element {TABLE} {name} {{ {', '.join(elements)} }}"
        for name, elements in per_set.items()
        if elements
    ]
