"""The pods' network options: defaults, every rule, and the error naming option and rule."""

from __future__ import annotations

import argparse
import ipaddress

import pytest

from feos.errors import Code, FeosError
from feos.net._options import (
    NO_PREFIX_REASON,
    add_network_arguments,
    network_options_from_args,
    parse_network_options,
)


def test_defaults() -> None:
    o = parse_network_options(pod_prefix="2001:db8:0:1::/64")
    assert o.pod_prefix == ipaddress.ip_network("2001:db8:0:1::/64")
    assert str(o.ipv4_range) == "169.254.16.0/20"
    assert str(o.dns_address) == "169.254.0.53"
    assert str(o.otlp_address) == "169.254.169.1"
    assert [str(u) for u in o.dns_upstreams] == [
        "2001:4860:4860::8888", "2606:4700:4700::1111", "8.8.8.8", "1.1.1.1"]
    assert o.deny_prefixes == ()
    assert o.unavailable_reason is None
    assert o.require_network() == o.pod_prefix


def test_no_prefix_is_a_reason_not_an_error() -> None:
    o = parse_network_options()
    assert o.unavailable_reason == NO_PREFIX_REASON
    with pytest.raises(FeosError) as e:
        o.require_network()
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "--pod-prefix" in e.value.message


@pytest.mark.parametrize(
    ("kwargs", "option", "words"),
    [
        ({"pod_prefix": "10.0.0.0/8"}, "--pod-prefix", "IPv6"),
        ({"pod_prefix": "2001:db8::/121"}, "--pod-prefix", "/1 to /120"),
        ({"pod_prefix": "::/0"}, "--pod-prefix", "/1 to /120"),
        ({"pod_prefix": "2001:db8::1/64"}, "--pod-prefix", "host bits"),
        ({"pod_prefix": "nonsense"}, "--pod-prefix", "prefix"),
        ({"pod_ipv4_range": "169.254.16.0/31"}, "--pod-ipv4-range", "/1 to /30"),
        ({"pod_ipv4_range": "fd00::/64"}, "--pod-ipv4-range", "IPv4"),
        ({"pod_ipv4_range": "169.254.0.0/16"}, "--pod-ipv4-range", "resolver"),
        ({"pod_ipv4_range": "169.254.0.0/30"}, "--pod-ipv4-range", "169.254.0.1"),
        ({"dns_address": "169.254.0.1"}, "--dns-address", "169.254.0.1"),
        ({"dns_address": "fd00::53"}, "--dns-address", "IPv4"),
        ({"otlp_address": "169.254.0.1"}, "--otlp-address", "169.254.0.1"),
        ({"otlp_address": "169.254.0.53"}, "--otlp-address", "resolver"),
        ({"otlp_address": "169.254.169.254"}, "--otlp-address", "metadata"),
        ({"otlp_address": "169.254.16.9"}, "--otlp-address", "range"),
        ({"otlp_address": "10.1.2.3", "deny_prefixes": ["10.0.0.0/8"]}, "--otlp-address",
         "denied"),
        ({"otlp_address": "::1"}, "--otlp-address", "IPv4"),
        ({"dns_upstreams": ["dns.google"]}, "--dns-upstream", "not an IP"),
        ({"deny_prefixes": ["10.0.0.1/8"]}, "--deny-prefix", "host bits"),
    ],
)
def test_rules(kwargs: dict[str, object], option: str, words: str) -> None:
    with pytest.raises(FeosError) as e:
        parse_network_options(**{"pod_prefix": "2001:db8::/64", **kwargs})  # type: ignore[arg-type]
    assert e.value.code == Code.INVALID_ARGUMENT
    assert e.value.message.startswith(option + ":")
    assert words in e.value.message


def test_moved_resolver_and_range() -> None:
    o = parse_network_options(
        pod_prefix="2001:db8::/96", pod_ipv4_range="100.64.0.0/16", dns_address="100.65.0.53",
        otlp_address="100.65.0.54", deny_prefixes=["10.0.0.0/8", "fd00::/8"],
        dns_upstreams=["9.9.9.9"])
    assert str(o.dns_address) == "100.65.0.53"
    assert [str(d) for d in o.deny_prefixes] == ["10.0.0.0/8", "fd00::/8"]
    assert [str(u) for u in o.dns_upstreams] == ["9.9.9.9"]


def test_argparse_roundtrip() -> None:
    p = argparse.ArgumentParser()
    add_network_arguments(p)
    args = p.parse_args(["--pod-prefix", "2001:db8::/80", "--deny-prefix", "10.0.0.0/8",
                         "--deny-prefix", "fc00::/7", "--dns-upstream", "1.1.1.1"])
    o = network_options_from_args(args)
    assert o.pod_prefix is not None
    assert o.pod_prefix.prefixlen == 80
    assert len(o.deny_prefixes) == 2
    assert [str(u) for u in o.dns_upstreams] == ["1.1.1.1"]
