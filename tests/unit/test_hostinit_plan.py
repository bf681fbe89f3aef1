"""feos-host-init's pure decisions: the command line's prefix, resolv.conf, NTP order, a DHCPv4
lease's routes, a DHCPv6 lease's timers, the pod prefix after a delegation, the programs' output
as /dev/kmsg records."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.hostinit._plan import (
    INFINITY,
    INITRAMFS_RESOLVERS,
    LINE_MAX,
    NtpServer,
    Route4,
    cmdline_pod_prefix,
    lease4_routes,
    lease6_timers,
    ntp_order,
    pod_prefix_after_delegation,
    program_records,
    resolv_conf,
    resolvers_in_turn,
)

A6 = ipaddress.IPv6Address
A4 = ipaddress.IPv4Address


def test_cmdline_prefix_taken_last_one_wins() -> None:
    line = "console=ttyS0 feos.pod-prefix=2001:db8:1::/64 quiet feos.pod-prefix=2001:db8:2::/80"
    assert cmdline_pod_prefix(line) == ipaddress.IPv6Network("2001:db8:2::/80")
    assert cmdline_pod_prefix("console=ttyS0 root=/dev/vda") is None


@pytest.mark.parametrize(
    "bad", ["10.0.0.0/8", "2001:db8::1/64", "2001:db8::/121", "::/0", "nonsense", ""]
)
def test_cmdline_bad_prefix_names_itself(bad: str) -> None:
    with pytest.raises(FeosError) as err:
        cmdline_pod_prefix(f"quiet feos.pod-prefix={bad}")
    assert err.value.code == Code.INVALID_ARGUMENT
    assert f"feos.pod-prefix={bad}" in err.value.message


def test_resolvers_alternate_families_ipv6_first() -> None:
    v6 = [A6("2001:db8::53"), A6("2001:db8::54")]
    v4 = [A4("10.0.0.53")]
    assert resolvers_in_turn(v6, v4) == [v6[0], v4[0], v6[1]]
    text = resolv_conf(v6, v4)
    assert text.splitlines()[1:] == [
        "nameserver 2001:db8::53", "nameserver 10.0.0.53", "nameserver 2001:db8::54",
    ]


def test_resolv_conf_keeps_initramfs_resolvers_until_dhcp_names_any() -> None:
    lines = resolv_conf([], []).splitlines()
    assert lines[1:] == [f"nameserver {a}" for a in INITRAMFS_RESOLVERS]
    assert "initramfs" in lines[0]


@given(st.lists(st.integers(0, 2**128 - 1).map(A6), max_size=5),
       st.lists(st.integers(0, 2**32 - 1).map(A4), max_size=5))
def test_resolvers_each_once_all_kept(v6: list[A6], v4: list[A4]) -> None:
    out = resolvers_in_turn(v6, v4)
    assert len(out) == len(set(out))
    assert set(out) == set(v6) | set(v4)


def test_ntp_order_dhcp6_then_dhcp4_then_pool_by_v6_then_v4() -> None:
    order = ntp_order([A6("2001:db8::123"), "ntp.example"], [A4("10.0.0.123")])
    assert order == [
        NtpServer("2001:db8::123", 6), NtpServer("ntp.example", 6), NtpServer("10.0.0.123", 4),
        NtpServer("pool.ntp.org", 6), NtpServer("pool.ntp.org", 4),
    ]


def test_lease4_router_inside_prefix_default_route_only() -> None:
    addr = ipaddress.IPv4Interface("10.0.0.5/24")
    assert lease4_routes(addr, [A4("10.0.0.1"), A4("10.0.0.2")]) == [Route4(None, A4("10.0.0.1"))]


def test_lease4_router_outside_prefix_on_link_first() -> None:
    addr = ipaddress.IPv4Interface("203.0.113.7/32")
    assert lease4_routes(addr, [A4("203.0.113.1")]) == [
        Route4(ipaddress.IPv4Network("203.0.113.1/32"), None), Route4(None, A4("203.0.113.1")),
    ]
    assert lease4_routes(addr, []) == []


def test_lease6_timers_as_given() -> None:
    t = lease6_timers(100, 160, [(200, 300)])
    assert (t.t1, t.t2, t.end) == (100, 160, 300)


def test_lease6_timers_left_to_client_half_and_eight_tenths_of_preferred() -> None:
    t = lease6_timers(0, 0, [(200, 400), (100, 300)])
    assert (t.t1, t.t2, t.end) == (50, 80, 400)


def test_lease6_timers_infinite() -> None:
    t = lease6_timers(INFINITY, INFINITY, [(INFINITY, INFINITY)])
    assert t.t1 == t.t2 == t.end == float("inf")


def test_lease6_without_spans_refused() -> None:
    with pytest.raises(FeosError):
        lease6_timers(1, 2, [])


@given(st.integers(0, INFINITY), st.integers(0, INFINITY),
       st.lists(st.tuples(st.integers(0, INFINITY), st.integers(0, INFINITY)), min_size=1))
def test_lease6_timers_ordered(t1: int, t2: int, spans: list[tuple[int, int]]) -> None:
    t = lease6_timers(t1, t2, spans)
    assert t.t1 <= t.t2 <= t.end


def test_the_api_on_tcp_is_tls_with_the_operators_ca_or_nothing() -> None:
    from feos.hostinit._plan import TCP_CERT, TCP_CLIENT_CA, TCP_KEY, tcp_options

    args, said = tcp_options([TCP_CLIENT_CA, TCP_CERT, TCP_KEY], "console=ttyS0")
    assert args == ["--tcp", "[::]:1337", "--tcp-client-ca", TCP_CLIENT_CA,
                    "--tcp-cert", TCP_CERT, "--tcp-key", TCP_KEY]  # fmt: skip
    args, _ = tcp_options([TCP_CLIENT_CA, TCP_CERT], "")  # a certificate without its key
    assert args == ["--tcp", "[::]:1337", "--tcp-client-ca", TCP_CLIENT_CA]
    args, said = tcp_options([], "console=ttyS0 feos.tcp-insecure=1")
    assert args == ["--tcp", "[::]:1337", "--tcp-insecure"] and "WITHOUT TLS" in said
    args, said = tcp_options([TCP_CERT, TCP_KEY], "feos.tcp-insecure=10")
    assert args == [] and "no API on TCP" in said and TCP_CLIENT_CA in said


N6 = ipaddress.IPv6Network


def test_pod_prefix_after_a_delegation() -> None:
    p1, p2 = N6("2001:db8:1::/56"), N6("2001:db8:2::/56")
    assert pod_prefix_after_delegation(None, p1, fixed=False) == (p1, True)  # after the 30 s
    assert pod_prefix_after_delegation(p1, p1, fixed=False) == (p1, False)  # a renewal
    assert pod_prefix_after_delegation(p1, p2, fixed=False) == (p2, True)
    assert pod_prefix_after_delegation(p1, None, fixed=False) == (p1, False)  # kept when lost
    assert pod_prefix_after_delegation(p1, p2, fixed=True) == (p1, False)  # the command line's
    assert pod_prefix_after_delegation(None, None, fixed=False) == (None, False)


def test_program_records_level_and_pieces() -> None:
    info = b"2026-12-02 07:11:32,845 diskd INFO diskd: serving\n"
    assert program_records("diskd", info) == [b"<6>diskd: " + info.rstrip() + b"\n"]
    warn = b"2026-12-02 07:12:24,612 feosd WARNING feos._host: asked to reboot\r\n"
    assert program_records("feosd", warn)[0].startswith(b"<4>feosd: 2026-12-02 ")
    assert program_records("feosd", b"x ERROR y")[0] == b"<3>feosd: x ERROR y\n"
    assert program_records("feosd", b"Traceback (most recent call last):\n")[0][:3] == b"<6>"
    assert program_records("feosd", b"\n") == [b"<6>feosd: \n"]
    assert program_records("feosd", b"a\0b\n") == [b"<6>feosd: ab\n"]


@given(st.binary(max_size=5 * LINE_MAX))
def test_program_records_keep_the_text_each_fits_kmsg(text: bytes) -> None:
    line = text.replace(b"\n", b"").replace(b"\r", b"").replace(b"\0", b"")
    records = program_records("feosd", line + b"\n")
    assert all(len(r) < 1024 and r.endswith(b"\n") and r.count(b"\n") == 1 for r in records)
    assert b"".join(r.split(b": ", 1)[1][:-1] for r in records) == line
