"""Security groups: the model the node keeps and compiles, and the rules a group must follow.

The model (the Cap'n Proto schema and the SecurityGroupService store mirror it field by field):

SecurityGroup
  id         text: one DNS label in lower case, 1 to 63 of a-z, 0-9 and "-", neither first nor
             last a "-" (RFC 1123). A lowercase UUID (8-4-4-4-12 hex digits) is such a label, so
             the control plane may use either; upper case is refused, not folded, so that one
             group has one spelling in every pod spec and set name (g-<id>).
  rules_in   list of Rule, at most MAX_RULES: what may reach the group's pods (IPv6 only).
  rules_out  list of Rule, at most MAX_RULES: what the group's pods may reach.

Rule (the attrs class takes them as Rule(protocol, peer, ports=None))
  protocol   one of any, tcp, udp, icmp, icmpv6 (an enum: ANY=0, TCP=1, UDP=2, ICMP=3, ICMPV6=4).
  ports      optional (first, last), 1 <= first <= last <= 65535; only with tcp or udp; one port
             is (p, p). Absent: every port. It is the destination port: of the peer for a rule
             out, of the group's pod for a rule in.
  peer       a union of
               block  an address block: cidr (text, "2001:db8::/32" or "192.0.2.0/24", host bits
                      zero) and excepts (list of CIDR text, at most MAX_EXCEPTS, each inside the
                      block and of its family); the peer is the block without its excepts;
               group  the ID of a group: its members, the IPv6 addresses of the pods that name it
                      (a group the node does not have has no members).

Rules of the family a direction cannot see are kept but match nothing: the in- chains are of IPv6
alone (nothing new comes in over IPv4, which leaves the node masqueraded), so a rule in with an
IPv4 block, or a rule in of ICMP, is ignored. ICMP rules take IPv4 blocks only, ICMPv6 rules IPv6
blocks or groups (a group's members are IPv6).

The default group, what a pod that names no group has, is not a SecurityGroup: out to the
internet (every address the deny sets leave, of both families), nothing in (see _nft.py).

Validation raises feos.errors.invalid(field, rule) with the field's path in snake case, such as
`rules_out[2].peer.block.excepts[0]: must be inside 10.0.0.0/8`.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Sequence

import attrs

from feos.errors import invalid

MAX_RULES = 128
"""Rules per direction of one group: a pod's chain is the rules of all its groups."""
MAX_EXCEPTS = 32
"""Excepts per block: the block's set holds up to 128 prefixes per except of its family."""
MAX_GROUPS_PER_POD = 16

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")


class Protocol(enum.IntEnum):
    ANY = 0
    TCP = 1
    UDP = 2
    ICMP = 3
    ICMPV6 = 4


@attrs.frozen
class Ports:
    first: int
    last: int


@attrs.frozen
class Block:
    """An address block without its exceptions."""

    cidr: Network
    excepts: tuple[Network, ...] = ()

    @property
    def version(self) -> int:
        return self.cidr.version


@attrs.frozen
class GroupPeer:
    """The members of a group: the IPv6 addresses of the pods that name it."""

    group_id: str


Peer = Block | GroupPeer


@attrs.frozen
class Rule:
    protocol: Protocol
    peer: Peer
    ports: Ports | None = None


@attrs.frozen
class SecurityGroup:
    id: str
    rules_in: tuple[Rule, ...] = ()
    rules_out: tuple[Rule, ...] = ()


def validate_group_id(group_id: str, field: str = "id") -> None:
    if not _LABEL.match(group_id):
        raise invalid(field, "must be one lowercase DNS label (a-z, 0-9, '-'; 1 to 63) or UUID")


def validate_pod_groups(group_ids: Sequence[str], field: str = "security_groups") -> None:
    """The groups a pod's spec names: valid IDs, no repeats, at most MAX_GROUPS_PER_POD."""
    if len(group_ids) > MAX_GROUPS_PER_POD:
        raise invalid(field, f"at most {MAX_GROUPS_PER_POD} groups")
    for i, group_id in enumerate(group_ids):
        validate_group_id(group_id, f"{field}[{i}]")
        if group_id in group_ids[:i]:
            raise invalid(f"{field}[{i}]", f"{group_id} is named twice")


def parse_cidr(text: str, field: str) -> Network:
    """A CIDR of either family, host bits zero: what a block and its excepts are written as."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise invalid(field, f"must be a CIDR with its host bits zero ({e})") from None


def parse_block(cidr: str, excepts: Sequence[str], field: str = "peer.block") -> Block:
    """A block from its text, validated as validate_group validates it."""
    block = Block(
        parse_cidr(cidr, f"{field}.cidr"),
        tuple(parse_cidr(e, f"{field}.excepts[{i}]") for i, e in enumerate(excepts)),
    )
    _validate_block(block, field)
    return block


def validate_group(group: SecurityGroup) -> None:
    """Raise INVALID_ARGUMENT naming the first field that breaks a rule of the model."""
    validate_group_id(group.id)
    for name, rules in (("rules_in", group.rules_in), ("rules_out", group.rules_out)):
        if len(rules) > MAX_RULES:
            raise invalid(name, f"at most {MAX_RULES} rules")
        for i, rule in enumerate(rules):
            validate_rule(rule, f"{name}[{i}]")


def validate_rule(rule: Rule, field: str) -> None:
    if not isinstance(rule.protocol, Protocol):
        raise invalid(f"{field}.protocol", "must be any, tcp, udp, icmp or icmpv6")
    _validate_ports(rule, f"{field}.ports")
    if isinstance(rule.peer, GroupPeer):
        validate_group_id(rule.peer.group_id, f"{field}.peer.group")
        if rule.protocol == Protocol.ICMP:
            raise invalid(f"{field}.protocol", "icmp is of IPv4: a group's members are IPv6")
        return
    _validate_block(rule.peer, f"{field}.peer.block")
    if rule.protocol == Protocol.ICMP and rule.peer.version != 4:
        raise invalid(f"{field}.protocol", "icmp rules take IPv4 blocks only")
    if rule.protocol == Protocol.ICMPV6 and rule.peer.version != 6:
        raise invalid(f"{field}.protocol", "icmpv6 rules take IPv6 blocks only")


def _validate_ports(rule: Rule, field: str) -> None:
    if rule.ports is None:
        return
    if rule.protocol not in (Protocol.TCP, Protocol.UDP):
        raise invalid(field, "only tcp and udp rules have ports")
    first, last = rule.ports.first, rule.ports.last
    if not 1 <= first <= last <= 65535:
        raise invalid(field, "must be 1 to 65535, first <= last")


def _validate_block(block: Block, field: str) -> None:
    if len(block.excepts) > MAX_EXCEPTS:
        raise invalid(f"{field}.excepts", f"at most {MAX_EXCEPTS}")
    for i, ex in enumerate(block.excepts):
        if ex.version != block.cidr.version:
            raise invalid(f"{field}.excepts[{i}]", f"must be of the family of {block.cidr}")
        if not ex.subnet_of(block.cidr):  # type: ignore[arg-type]
            raise invalid(f"{field}.excepts[{i}]", f"must be inside {block.cidr}")


def block_remainder(block: Block) -> list[Network]:
    """The block without its excepts, as the fewest prefixes, in address order."""
    parts: list[Network] = [block.cidr]
    for ex in block.excepts:
        parts = [rest for part in parts for rest in _exclude(part, ex)]
    return list(ipaddress.collapse_addresses(parts))  # type: ignore[type-var]


def _exclude(net: Network, ex: Network) -> list[Network]:
    if not net.overlaps(ex):
        return [net]
    if net.subnet_of(ex):  # type: ignore[arg-type]
        return []
    return list(net.address_exclude(ex))  # type: ignore[arg-type]
