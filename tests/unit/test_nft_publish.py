"""Published ports in the compiled table: the DNAT chains, the in- chains' admission, the plans."""

from __future__ import annotations

import ipaddress as ip

import attrs

from feos.net._contract import PublishedPort
from feos.net._nft import NodeFacts, PodNet, change_kind, compile_table, plan, render_full

FACTS = NodeFacts(ip.IPv6Network("fd12:3456::/64"))
POD = PodNet("pod-00000001", ip.IPv6Address("fd12:3456::2"), ip.IPv4Address("169.254.16.2"))


def published(*ports: PublishedPort) -> PodNet:
    return attrs.evolve(POD, published=ports)


def tcp(host: int, pod: int, address: str = "") -> PublishedPort:
    return PublishedPort("tcp", address, host, pod)


def test_nat_base_chains_jump_to_publish_for_the_node_s_own_addresses() -> None:
    chains = compile_table([POD], {}, FACTS).chain_map()
    assert chains["nat-prerouting"].hook == (
        "type nat hook prerouting priority -100; policy accept;")
    assert chains["nat-prerouting"].rules == (
        'iifname "pod-*" return',  # pods do not reach each other through the node's addresses
        "ip daddr 169.254.0.0/16 return",
        "ip6 daddr fe80::/10 return",
        "fib daddr type local jump publish",
    )
    assert chains["nat-output"].hook == "type nat hook output priority -100; policy accept;"
    assert chains["nat-output"].rules == (
        "ip6 daddr ::1 return",  # feosd's relay takes ::1
        "ip daddr 169.254.0.0/16 return",
        "ip6 daddr fe80::/10 return",
        "fib daddr type local jump publish",
    )
    assert chains["publish"].rules == ()


def test_every_address_dnats_both_families_to_the_pod_s_own() -> None:
    chains = compile_table([published(tcp(8080, 80))], {}, FACTS).chain_map()
    assert chains["publish"].rules == (
        "meta nfproto ipv4 tcp dport 8080 dnat ip to 169.254.16.2:80",
        "meta nfproto ipv6 tcp dport 8080 dnat ip6 to [fd12:3456::2]:80",
    )
    assert chains["in-pod-00000001"].rules[-3] == (
        "tcp dport 80 ct status dnat ct original proto-dst 8080 return")
    assert chains["in-pod-00000001"].rules[-1] == "counter drop"


def test_an_address_limits_the_family_and_the_destination() -> None:
    pod = published(tcp(8080, 80, "192.0.2.1"), tcp(8081, 80, "2001:db8::1"),
                    PublishedPort("udp", "0.0.0.0", 5353, 53), PublishedPort("udp", "::", 5354, 53))
    rules = compile_table([pod], {}, FACTS).chain_map()["publish"].rules
    assert rules == (
        "ip daddr 192.0.2.1 tcp dport 8080 dnat ip to 169.254.16.2:80",
        "ip6 daddr 2001:db8::1 tcp dport 8081 dnat ip6 to [fd12:3456::2]:80",
        "meta nfproto ipv4 udp dport 5353 dnat ip to 169.254.16.2:53",
        "meta nfproto ipv6 udp dport 5354 dnat ip6 to [fd12:3456::2]:53",
    )
    admitted = [r for r in compile_table([pod], {}, FACTS).chain_map()["in-pod-00000001"].rules
                if "ct status dnat" in r]
    assert admitted == [
        "tcp dport 80 ct status dnat ct original proto-dst 8080 return",
        "tcp dport 80 ct status dnat ct original proto-dst 8081 return",
        "udp dport 53 ct status dnat ct original proto-dst 5353 return",
        "udp dport 53 ct status dnat ct original proto-dst 5354 return",
    ]


def test_without_a_publish_nothing_is_admitted() -> None:
    rules = compile_table([POD], {}, FACTS).chain_map()["in-pod-00000001"].rules
    assert not any("dnat" in r for r in rules)


def test_input_takes_replies_of_the_node_s_own_connections_only() -> None:
    rules = compile_table([POD], {}, FACTS).chain_map()["input"].rules
    assert 'iifname "pod-*" ct direction reply ct state established accept' in rules


def test_a_pod_with_a_publish_coming_and_going_is_a_chains_delta() -> None:
    other = PodNet("pod-00000002", ip.IPv6Address("fd12:3456::3"), ip.IPv4Address("169.254.16.3"))
    before = compile_table([other], {}, FACTS)
    after = compile_table([other, published(tcp(8080, 80))], {}, FACTS)
    assert change_kind(before, after) == "chains"
    script = plan(before, after).script
    assert "flush chain inet feos publish" in script
    assert "add rule inet feos publish meta nfproto ipv4 tcp dport 8080" in script
    back = plan(after, before).script
    assert "flush chain inet feos publish" in back and "dnat" not in back


def test_rendered_once_in_the_full_script() -> None:
    text = render_full(compile_table([published(tcp(8080, 80))], {}, FACTS))
    assert text.count("dnat ip to 169.254.16.2:80") == 1
    assert "type nat hook output priority -100" in text


def test_a_ula_prefix_s_pods_see_other_ipv6_sources_as_its_first_address() -> None:
    post = compile_table([POD], {}, FACTS).chain_map()["postrouting"].rules
    assert 'oifname "pod-*" ct status dnat ip6 saddr != fc00::/7 snat ip6 to fd12:3456::1' in post
    routed = NodeFacts(ip.IPv6Network("2001:db8:1::/64"))
    post = compile_table([POD], {}, routed).chain_map()["postrouting"].rules
    assert not any("snat" in r for r in post)  # a routed prefix's pods answer anyone
