"""The start-up steps and a pod's TAP device, made in a throwaway namespace and read back."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from feos.net._links import (
    DNS_DEVICE,
    METADATA_TABLE,
    TapSpec,
    delete_tap,
    make_tap,
    netns_entered,
    prepare_node,
    tap_name,
)
from feos.net._options import parse_network_options

OPTIONS = parse_network_options(pod_prefix="2001:db8:1::/64")


def _ip_json(ns: Any, *argv: str) -> Any:
    return json.loads(ns.run("ip", "-j", *argv).stdout or "[]")


def _sysctl(ns: Any, key: str) -> str:
    return ns.run("sysctl", "-n", key).stdout.strip()


def _spec() -> TapSpec:
    return TapSpec(tap_name("abcdefghjkm"), ipaddress.IPv6Address("2001:db8:1::2"),
                   ipaddress.IPv4Address("169.254.16.1"), OPTIONS.dns_address,
                   OPTIONS.otlp_address, owner_uid=4242)


async def test_start_up_steps(netns: Any) -> None:
    netns.run("ip", "link", "add", "up0", "type", "veth", "peer", "name", "up1")
    netns.run("sysctl", "-qw", "net.ipv6.conf.up0.accept_ra=1")
    first = await prepare_node(OPTIONS, netns.name)
    assert "up0" in first.accept_ra_raised
    again = await prepare_node(OPTIONS, netns.name)  # idempotent: nothing left to do
    assert again.accept_ra_raised == ()
    assert first.dns_device_kind in ("dummy", "tun")
    assert _sysctl(netns, "net.ipv4.ip_forward") == "1"
    assert _sysctl(netns, "net.ipv6.conf.all.forwarding") == "1"
    assert _sysctl(netns, "net.ipv6.conf.up0.accept_ra") == "2"
    routes = _ip_json(netns, "-6", "route", "show", "type", "unreachable")
    assert [r["dst"] for r in routes] == ["2001:db8:1::/64"]
    (dev,) = _ip_json(netns, "addr", "show", "dev", DNS_DEVICE)
    assert "UP" in dev["flags"]
    glob = [(a["local"], a["prefixlen"]) for a in dev["addr_info"] if a["scope"] == "global"]
    assert glob == [("169.254.0.53", 32), ("169.254.169.1", 32)]
    local = _ip_json(netns, "route", "show", "table", str(METADATA_TABLE))
    assert [(r["type"], r["dst"]) for r in local] == [("local", "169.254.169.254")]


async def test_stray_address_on_dns_device_is_removed(netns: Any) -> None:
    await prepare_node(OPTIONS, netns.name)
    netns.run("ip", "addr", "add", "10.9.9.9/24", "dev", DNS_DEVICE)
    netns.run("ip", "addr", "add", "2001:db8:9::9/64", "dev", DNS_DEVICE)
    await prepare_node(OPTIONS, netns.name)
    (dev,) = _ip_json(netns, "addr", "show", "dev", DNS_DEVICE)
    assert [a["local"] for a in dev["addr_info"] if a["scope"] == "global"] == [
        "169.254.0.53", "169.254.169.1"]


async def test_tap_made_as_listed_and_removed(netns: Any) -> None:
    await prepare_node(OPTIONS, netns.name)
    spec = _spec()
    idx = await make_tap(spec, netns.name)
    assert await make_tap(spec, netns.name) == idx  # a second bring-up finds it done
    name = spec.name
    assert name == "pod-abcdefghjkm"
    for key, want in [("net.ipv6.conf.{}.accept_ra", "0"), ("net.ipv6.conf.{}.autoconf", "0"),
                      ("net.ipv6.conf.{}.addr_gen_mode", "1"),
                      ("net.ipv6.conf.{}.forwarding", "1"),
                      ("net.ipv4.conf.{}.arp_ignore", "1"), ("net.ipv4.conf.{}.arp_announce", "2"),
                      ("net.ipv4.conf.{}.forwarding", "1"), ("net.ipv4.neigh.{}.proxy_delay", "0")]:
        assert _sysctl(netns, key.format(name)) == want, key
    (link,) = _ip_json(netns, "-d", "link", "show", "dev", name)
    assert link["linkinfo"]["info_kind"] == "tun"
    assert link["linkinfo"]["info_data"]["type"] == "tap"
    assert link["linkinfo"]["info_data"]["user"] in (4242, "4242")
    assert "UP" in link["flags"]
    (dev,) = _ip_json(netns, "addr", "show", "dev", name)
    v4 = [(a["local"], a["prefixlen"]) for a in dev["addr_info"] if a["family"] == "inet"]
    assert v4 == [("169.254.0.53", 32), ("169.254.169.1", 32)]  # the resolver's first
    v6 = [a for a in dev["addr_info"] if a["family"] == "inet6"]
    assert [(a["local"], a["prefixlen"]) for a in v6] == [("fe80::1", 64)]  # no kernel LL
    assert v6[0].get("nodad") is True
    proxies = _ip_json(netns, "neigh", "show", "proxy", "dev", name)
    assert [p["dst"] for p in proxies] == ["169.254.0.1"]
    r6 = _ip_json(netns, "-6", "route", "show", "2001:db8:1::2/128")
    assert [r["dev"] for r in r6] == [name]
    r4 = _ip_json(netns, "route", "show", "169.254.16.1/32")
    assert [r["dev"] for r in r4] == [name]
    rules = [r for r in _ip_json(netns, "rule", "show") if r.get("iif") == name]
    assert [(r["dst"], r["table"]) for r in rules] == [("169.254.169.254", str(METADATA_TABLE))]

    assert await delete_tap(name, netns.name) is True
    assert await delete_tap(name, netns.name) is False
    assert netns.run("ip", "link", "show", "dev", name, check=False).returncode != 0
    assert _ip_json(netns, "route", "show", "169.254.16.1/32") == []
    assert _ip_json(netns, "neigh", "show", "proxy") == []
    assert [r for r in _ip_json(netns, "rule", "show") if r.get("iif") == name] == []


async def test_tap_with_wrong_address_order_is_mended(netns: Any) -> None:
    await prepare_node(OPTIONS, netns.name)
    spec = _spec()
    await make_tap(spec, netns.name)
    netns.run("ip", "addr", "del", "169.254.0.53/32", "dev", spec.name)
    netns.run("ip", "addr", "add", "169.254.0.53/32", "dev", spec.name)  # now second
    await make_tap(spec, netns.name)
    (dev,) = _ip_json(netns, "addr", "show", "dev", spec.name)
    assert [a["local"] for a in dev["addr_info"] if a["family"] == "inet"] == [
        "169.254.0.53", "169.254.169.1"]



ATTACH = """
import fcntl, struct, sys
try:
    fcntl.ioctl(int(sys.argv[1]), 0x400454CA, struct.pack("16sH", sys.argv[2].encode(), 0x1002))
except OSError as e:
    print(e.errno)
else:
    print(0)
"""


def _attach_as(netns: Any, uid: int, name: str) -> int:
    """0 if a process of `uid` attaches a queue to the TAP, else its errno. The kernel checks
    the caller at TUNSETIFF; the machine's /dev/net/tun may be root's alone (0600), so the
    process gets it open (in the namespace: the device's lookup is in the opener's)."""
    import os
    import subprocess
    import sys

    with netns_entered(netns.name):
        fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", netns.name, "setpriv", f"--reuid={uid}", f"--regid={uid}",
             "--clear-groups", sys.executable, "-c", ATTACH, str(fd), name],
            pass_fds=(fd,), capture_output=True, text=True, check=True)
    finally:
        os.close(fd)
    return int(done.stdout)


async def test_tap_belongs_to_the_microvms_user(netns: Any) -> None:
    await prepare_node(OPTIONS, netns.name)
    spec = _spec()
    await make_tap(spec, netns.name)
    sysfs = f"/sys/class/net/{spec.name}"
    owner = netns.run("cat", f"{sysfs}/owner", f"{sysfs}/group")
    assert owner.stdout.split() == ["4242", "4242"]
    assert _attach_as(netns, 4242, spec.name) == 0
    assert _attach_as(netns, 4243, spec.name) == 1  # EPERM: not its user's


async def test_a_tap_of_roots_is_given_to_the_microvms_user(netns: Any) -> None:
    await prepare_node(OPTIONS, netns.name)
    spec = _spec()
    netns.run("ip", "tuntap", "add", "dev", spec.name, "mode", "tap", "vnet_hdr")  # root's
    await make_tap(spec, netns.name)
    (link,) = _ip_json(netns, "-d", "link", "show", "dev", spec.name)
    data = link["linkinfo"]["info_data"]
    assert (str(data["user"]), str(data["group"]), data["vnet_hdr"]) == ("4242", "4242", True)
