"""The security-group model's validation: every refusal names its field."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net._groups import (
    MAX_RULES,
    Block,
    GroupPeer,
    Ports,
    Protocol,
    Rule,
    SecurityGroup,
    block_remainder,
    parse_block,
    parse_cidr,
    validate_group,
    validate_group_id,
    validate_pod_groups,
)

ANY6 = parse_block("::/0", [])
ANY4 = parse_block("0.0.0.0/0", [])


def refusal(group: SecurityGroup) -> str:
    with pytest.raises(FeosError) as e:
        validate_group(group)
    assert e.value.code == Code.INVALID_ARGUMENT
    return e.value.message


@pytest.mark.parametrize(
    "group_id", ["web", "a", "db-1", "0", "22222222-3333-4444-5555-666666666666", "x" * 63]
)
def test_group_ids_taken(group_id: str) -> None:
    validate_group_id(group_id)


@pytest.mark.parametrize(
    "group_id",
    ["", "Web", "-web", "web-", "a.b", "a_b", "x" * 64, "22222222-3333-4444-5555-66666666666A"],
)
def test_group_ids_refused(group_id: str) -> None:
    with pytest.raises(FeosError, match=r"^INVALID_ARGUMENT: id: "):
        validate_group_id(group_id)


def test_a_valid_group() -> None:
    validate_group(
        SecurityGroup(
            "web",
            rules_in=(Rule(Protocol.TCP, GroupPeer("lb"), Ports(443, 443)),),
            rules_out=(
                Rule(Protocol.UDP, parse_block("10.0.0.0/8", ["10.1.0.0/16"]), Ports(53, 53)),
                Rule(Protocol.ICMP, ANY4),
                Rule(Protocol.ICMPV6, GroupPeer("lb")),
                Rule(Protocol.ANY, ANY6),
            ),
        )
    )


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (Rule(Protocol.TCP, ANY6, Ports(0, 10)), "rules_out[0].ports: must be 1 to 65535"),
        (Rule(Protocol.TCP, ANY6, Ports(10, 9)), "rules_out[0].ports: must be 1 to 65535"),
        (Rule(Protocol.UDP, ANY6, Ports(1, 65536)), "rules_out[0].ports: must be 1 to 65535"),
        (Rule(Protocol.ANY, ANY6, Ports(80, 80)), "rules_out[0].ports: only tcp and udp"),
        (Rule(Protocol.ICMP, ANY6), "rules_out[0].protocol: icmp rules take IPv4"),
        (Rule(Protocol.ICMPV6, ANY4), "rules_out[0].protocol: icmpv6 rules take IPv6"),
        (Rule(Protocol.ICMP, GroupPeer("web")), "rules_out[0].protocol: icmp is of IPv4"),
        (Rule(Protocol.ANY, GroupPeer("Web")), "rules_out[0].peer.group: must be one lowercase"),
    ],
)
def test_rules_refused(rule: Rule, message: str) -> None:
    assert refusal(SecurityGroup("web", rules_out=(rule,))).startswith(message)


def test_excepts_inside_their_block_and_family() -> None:
    outside = Block(ipaddress.ip_network("10.0.0.0/8"), (ipaddress.ip_network("11.0.0.0/16"),))
    family = Block(ipaddress.ip_network("10.0.0.0/8"), (ipaddress.ip_network("::/64"),))
    msg = refusal(SecurityGroup("web", rules_in=(Rule(Protocol.ANY, outside),)))
    assert msg == "rules_in[0].peer.block.excepts[0]: must be inside 10.0.0.0/8"
    msg = refusal(SecurityGroup("web", rules_in=(Rule(Protocol.ANY, family),)))
    assert msg == "rules_in[0].peer.block.excepts[0]: must be of the family of 10.0.0.0/8"
    with pytest.raises(FeosError, match=r"x.excepts\[1\]: must be inside"):
        parse_block("2001:db8::/32", ["2001:db8:1::/48", "2001:db9::/48"], "x")


def test_at_most_max_rules() -> None:
    rules = (Rule(Protocol.ANY, ANY6),) * (MAX_RULES + 1)
    assert refusal(SecurityGroup("web", rules_out=rules)) == f"rules_out: at most {MAX_RULES} rules"
    validate_group(SecurityGroup("web", rules_out=rules[:MAX_RULES]))


def test_cidrs_need_zero_host_bits() -> None:
    with pytest.raises(FeosError, match=r"^INVALID_ARGUMENT: f: must be a CIDR"):
        parse_cidr("10.0.0.1/8", "f")
    assert parse_cidr("2001:db8::/32", "f") == ipaddress.ip_network("2001:db8::/32")


def test_pod_groups() -> None:
    validate_pod_groups(["web", "db"])
    with pytest.raises(FeosError, match=r"security_groups\[1\]: web is named twice"):
        validate_pod_groups(["web", "web"])
    with pytest.raises(FeosError, match=r"security_groups: at most 16"):
        validate_pod_groups([f"g{i}" for i in range(17)])


def _code_of(fn: Callable[..., object], *args: str) -> Code | None:
    """The code of the FeosError fn raises, None if it returns; any other exception escapes."""
    try:
        fn(*args)
    except FeosError as e:
        return e.code
    return None


@given(st.text(max_size=80))
def test_any_text_is_an_id_or_invalid(text: str) -> None:
    code = _code_of(validate_group_id, text)
    assert code in (None, Code.INVALID_ARGUMENT)
    if code is None:
        assert 1 <= len(text) <= 63
        assert text == text.lower()


@given(st.text(max_size=60))
def test_any_text_is_a_cidr_or_invalid(text: str) -> None:
    code = _code_of(parse_cidr, text, "f")
    assert code in (None, Code.INVALID_ARGUMENT)
    if code is None:
        net = parse_cidr(text, "f")
        assert ipaddress.ip_network(str(net)) == net


nets4 = st.builds(
    lambda a, n: ipaddress.IPv4Network((a, n), strict=False),
    st.integers(0, 2**32 - 1),
    st.integers(8, 30),
)


@given(nets4, st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 32)), max_size=5))
def test_remainder_is_the_block_without_its_excepts(
    block: ipaddress.IPv4Network, raw: list[tuple[int, int]]
) -> None:
    excepts = []
    for offset, extra in raw:  # excepts inside the block, at random places and lengths
        length = min(32, block.prefixlen + extra % (33 - block.prefixlen))
        address = int(block.network_address) + offset % block.num_addresses
        excepts.append(ipaddress.IPv4Network((address, length), strict=False))
    parts = block_remainder(Block(block, tuple(excepts)))
    for part in parts:
        assert part.subnet_of(block)
        assert not any(part.overlaps(e) for e in excepts)
    covered = sum(p.num_addresses for p in parts)
    excluded = sum(e.num_addresses for e in ipaddress.collapse_addresses(excepts))
    assert covered + excluded == block.num_addresses
