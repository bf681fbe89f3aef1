"""The checks of a pod's DNS upstreams at create."""

from __future__ import annotations

import ipaddress

import pytest

from feos.errors import Code, FeosError
from feos.net._dnsupstream import DEFAULT_UPSTREAMS, validate_upstreams

FACTS = dict(
    resolver=ipaddress.IPv4Address("169.254.0.53"),
    denied=[ipaddress.ip_network("203.0.113.0/24"), ipaddress.ip_network("2001:db8:dead::/48")],
    pod_prefix=ipaddress.IPv6Network("2001:db8:1::/64"),
    pod_ipv4_range=ipaddress.IPv4Network("169.254.16.0/20"),
    node_addresses=[ipaddress.ip_address("192.0.2.10"), ipaddress.ip_address("2001:db8:2::10")],
)


def test_good_upstreams_pass_in_order() -> None:
    got = validate_upstreams(["2001:db8:5::53", "198.51.100.53"], **FACTS)
    assert got == (ipaddress.ip_address("2001:db8:5::53"), ipaddress.ip_address("198.51.100.53"))
    assert str(DEFAULT_UPSTREAMS[0]) == "2001:4860:4860::8888"
    assert [a.version for a in DEFAULT_UPSTREAMS] == [6, 6, 4, 4]


@pytest.mark.parametrize(
    ("upstream", "why"),
    [
        ("dns.google", "not an IP address"),
        ("8.8.8.8:53", "not an IP address"),
        ("169.254.0.53", "the resolver itself"),
        ("127.0.0.53", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.251", "multicast"),
        ("ff02::fb", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("203.0.113.9", "denied prefix"),
        ("2001:db8:dead::1", "denied prefix"),
        ("2001:db8:1::5", "a pod's address"),
        ("192.0.2.10", "the node's addresses"),
        ("2001:db8:2::10", "the node's addresses"),
    ],
)
def test_refused_upstreams_name_their_index_and_why(upstream: str, why: str) -> None:
    with pytest.raises(FeosError) as e:
        validate_upstreams(["198.51.100.53", upstream], **FACTS)
    assert e.value.code == Code.INVALID_ARGUMENT
    assert e.value.message.startswith("spec.network.dns_upstreams[1]: ")
    assert why in e.value.message


def test_pod_ipv4_range_is_refused_even_outside_link_local() -> None:
    facts = dict(FACTS, pod_ipv4_range=ipaddress.IPv4Network("100.64.0.0/16"))
    with pytest.raises(FeosError, match="a pod's address"):
        validate_upstreams(["100.64.3.4"], **facts)


def test_duplicates_and_too_many_are_refused() -> None:
    with pytest.raises(FeosError, match=r"dns_upstreams\[1\].*twice"):
        validate_upstreams(["198.51.100.1", "198.51.100.1"], **FACTS)
    with pytest.raises(FeosError, match="at most 8"):
        validate_upstreams([f"198.51.100.{i}" for i in range(9)], **FACTS)
