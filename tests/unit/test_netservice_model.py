"""The pure parts of the Network service: which pods the network knows, what the table's compiler
and the resolver are given, the guest's network, the metadata object and DNS records."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net import PodNet
from feos.net._dnsresolver import PodDns, QueryRecord
from feos.net._groups import SecurityGroup
from feos.net._nft import render_full
from feos.net._options import parse_network_options
from feos.net._service import Network
from feos.net._service_model import (
    compile_for,
    dns_pods,
    dns_record,
    guest_network_of,
    known_pods,
    metadata_of,
    missing_reason,
    pod_addresses,
    table_pods,
)

OPTIONS = parse_network_options(pod_prefix="2001:db8:1::/64")
V4, V6 = ipaddress.IPv4Address, ipaddress.IPv6Address


def pod(pod_id: str, n: int = 2, **kw: object) -> PodNet:
    base: dict[str, object] = dict(
        id=pod_id, ipv6=f"2001:db8:1::{n:x}", ipv4=f"169.254.16.{n}", security_groups=(),
        name_tables=(), dns_upstreams=(), metadata_json="", driver="qemu")
    base.update(kw)
    return PodNet(**base)  # type: ignore[arg-type]


A, B, C = "abcdefghjkm", "bcdefghjkmn", "cdefghjkmnp"


def test_known_pods_take_the_prepared_one_and_leave_the_removed_out() -> None:
    view = [pod(A, 2), pod(B, 3)]
    newer = attrs.evolve(view[0], security_groups=("web",))
    got = known_pods(view, {A: newer, C: pod(C, 4)}, {B})
    assert got == [newer, pod(C, 4)]
    assert known_pods(view, {}, {A, B}) == []


def test_addresses_of_another_network_are_not_this_ones() -> None:
    assert pod_addresses(pod(A), OPTIONS) == (V6("2001:db8:1::2"), V4("169.254.16.2"))
    old = pod(A, ipv6="2001:db8:9::2", ipv4="10.200.0.5")  # the first version's
    assert pod_addresses(old, OPTIONS) == (None, None)
    assert pod_addresses(pod(A, ipv6="", ipv4="garbage"), OPTIONS) == (None, None)


def test_table_pods_leave_out_pods_that_cannot_boot() -> None:
    groups = {"web": SecurityGroup("web")}
    pods = [pod(A, 2, security_groups=("web",)), pod(B, 3, security_groups=("gone",)),
            pod(C, 4, ipv4="", driver="firecracker"), pod("not-an-id", 5)]
    chosen, left = table_pods(pods, OPTIONS, groups)
    assert [(p.tap, p.groups, p.local_metadata) for p in chosen] == [
        (f"pod-{A}", ("web",), True)]
    assert left == [B, C, "not-an-id"]
    table = compile_for(pods, OPTIONS, groups, [V4("192.0.2.7")])
    script = render_full(table)
    assert f"out-pod-{A}" in script and f"pod-{B}" not in script
    assert "192.0.2.7" in script  # the node's own addresses are denied


_ids = st.from_regex(r"[a-hjkmnp-tv-z][0-9a-hjkmnp-tv-z]{10}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_ids, st.lists(st.sampled_from(["a", "b", "c"]), max_size=3,
                                         unique=True)), max_size=8, unique_by=lambda t: t[0]),
       st.sets(st.sampled_from(["a", "b", "c"])))
def test_any_pods_and_groups_compile(specs: list[tuple[str, list[str]]], have: set[str]) -> None:
    """Whatever the pods name and the node has, the table compiles: one pod's missing group
    never fails every pod's table."""
    pods = [pod(i, n + 2, security_groups=tuple(g)) for n, (i, g) in enumerate(specs)]
    groups = {g: SecurityGroup(g) for g in have}
    chosen, left = table_pods(pods, OPTIONS, groups)
    assert len(chosen) + len(left) == len(pods)
    assert all(set(p.groups) <= have for p in chosen)
    compile_for(pods, OPTIONS, groups, [])


def test_the_resolver_knows_pods_by_their_ipv4_address() -> None:
    pods = [pod(A, 2, name_tables=("t1", "t2"), dns_upstreams=("9.9.9.9", "bad")),
            pod(B, 3, ipv4="")]
    assert dns_pods(pods, OPTIONS) == {
        V4("169.254.16.2"): PodDns(A, ("t1", "t2"), (V4("9.9.9.9"),))}


def test_missing_groups_and_tables_are_named() -> None:
    p = pod(A, security_groups=("web", "db"), name_tables=("t1", "t2"))
    assert missing_reason(p, {"web", "db"}, {"t1", "t2"}) is None
    assert missing_reason(p, {"web"}, {"t1", "t2"}) == (
        f"pod {A}: the node does not have the security groups db")
    assert missing_reason(p, {"web"}, {"t2"}) == (
        f"pod {A}: the node does not have the security groups db and the name tables t1")


def test_guest_network() -> None:
    g = guest_network_of(pod(A), OPTIONS)
    assert (g.ipv6, g.ipv4, g.resolver, g.ula_only, g.mtu) == (
        "2001:db8:1::2", "169.254.16.2", "169.254.0.53", False, 1500)
    ula = parse_network_options(pod_prefix="fd00:1:2:3::/96")
    assert guest_network_of(pod(A, ipv6="fd00:1:2:3::9"), ula).ula_only
    assert guest_network_of(pod(A, ipv6="fd00:1:2:3::9"), ula).mtu == 1500  # not a mesh
    meshed = guest_network_of(pod(A, ipv6="fd00:1:2:3::9"), ula, meshed=True)
    assert (meshed.ula_only, meshed.mtu) == (True, 1420)  # WireGuard's MTU on a mesh


def test_metadata_object() -> None:
    assert metadata_of(pod(A, metadata_json='{"role": "web"}')) == {
        "feos": {"pod-id": A, "ipv6": "2001:db8:1::2", "ipv4": "169.254.16.2"},
        "metadata": {"role": "web"}}
    assert metadata_of(pod(A, metadata_json="[1]"))["metadata"] == {}


def test_dns_record_keeps_type_rcode_and_upstream() -> None:
    q = QueryRecord(12.5, "169.254.16.2", A, "web.", 28, 0, ("2001:db8::1",), "9.9.9.9", "udp")
    r = dns_record(q)
    assert (r.pod_id, r.name, r.qtype, r.rcode, r.answers, r.time) == (
        A, "web.", "AAAA", "NOERROR", ("2001:db8::1",), 12.5)
    assert (r.qtype_number, r.rcode_number, r.upstream) == (28, 0, "9.9.9.9")
    stranger = dns_record(attrs.evolve(q, pod=None, rcode=5, upstream=None))
    assert (stranger.pod_id, stranger.rcode, stranger.upstream) == ("", "REFUSED", "")


class _View:
    def network_pods(self) -> list[PodNet]:
        return []


class _Store:
    def get(self, key: str) -> None:
        return None

    def items(self) -> list[tuple[str, object]]:
        return []

    def __contains__(self, key: object) -> bool:
        return False


async def test_without_a_prefix_the_network_is_unavailable(tmp_path: Path) -> None:
    options = parse_network_options()
    net = Network(options, tmp_path, _View(), _Store(), _Store())
    await net.run()  # logs, reports started, serves nothing
    reason = net.unavailable()
    assert reason is not None and "--pod-prefix" in reason
    for call in (lambda: net.check_spec(pod(A)),):
        try:
            call()
        except FeosError as e:
            assert e.code == Code.FAILED_PRECONDITION and "--pod-prefix" in e.message
        else:
            raise AssertionError("check_spec passed without a network")
    try:
        await net.allocate(pod(A, ipv6="", ipv4=""))
    except FeosError as e:
        assert e.code == Code.FAILED_PRECONDITION
    else:
        raise AssertionError("allocate passed without a network")
    await net.remove(pod(A))  # idempotent, nothing to take down
    assert not (tmp_path / "pods").exists()


def test_check_spec_names_the_field(tmp_path: Path) -> None:
    net = Network(OPTIONS, tmp_path, _View(), _Store(), _Store())
    net._reason = None  # as once run() set the network up
    net.check_spec(pod(A, dns_upstreams=("9.9.9.9",), metadata_json=json.dumps({"k": 1})))
    cases = [
        (pod(A, dns_upstreams=("169.254.0.53",)), "spec.network.dns_upstreams[0]"),
        (pod(A, dns_upstreams=("2001:db8:1::9",)), "spec.network.dns_upstreams[0]"),
        (pod(A, metadata_json="{"), "spec.metadata"),
        (pod(A, metadata_json='{"bad key": 1}'), "spec.metadata"),
        (pod(A, security_groups=("Web",)), "spec.network.security_groups[0]"),
        (pod(A, name_tables=("ok", "no way")), "spec.network.name_tables[1]"),
    ]
    for p, field in cases:
        try:
            net.check_spec(p)
        except FeosError as e:
            assert e.code == Code.INVALID_ARGUMENT and e.message.startswith(field), e.message
        else:
            raise AssertionError(f"{field} passed")
