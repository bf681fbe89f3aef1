"""The guest's rtnetlink configuration against the kernel: the outcome ip(8) had, in namespaces.

Each test makes namespaces with a veth pair (d0 configured, its peer d1 up for a carrier). One
namespace gets the ip(8) commands the agent ran before (the reference), another the agent's
netlink messages; what `ip -j` reads back must be the same, also after a second configuration.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from conftest import Netns

MAC = "06:00:0a:0b:0c:0d"  # the same in every namespace: the link-local addresses match too

APPLY = """
import json, sys
from feos.errors import FeosError
from feos.guest import _system
try:
    _system.configure_network(*json.loads(sys.argv[1]))
    print(json.dumps(None))
except FeosError as e:
    print(json.dumps([e.code.name, e.message]))
"""


def reference(dev: str, ipv6: str, ula: bool, ipv4: str, mtu: int) -> list[list[str]]:
    """The ip(8) commands of feos.guest._system before rtnetlink ('-': may fail)."""
    m = ["mtu", str(mtu)] if mtu else []
    cmds = [
        ["link", "set", "dev", "lo", "up"],
        ["link", "set", "dev", dev, "up", *m],
        ["-", "-6", "route", "del", "default", "dev", dev],
        ["-", "-6", "route", "del", "fc00::/7", "dev", dev],
        ["-", "-6", "addr", "flush", "dev", dev, "scope", "global"],
        ["-", "-4", "route", "flush", "dev", dev],
        ["-", "-4", "addr", "flush", "dev", dev],
    ]
    if ipv6:
        dest = "fc00::/7" if ula else "default"
        cmds += [
            ["-6", "addr", "add", f"{ipv6}/128", "dev", dev, "nodad"],
            ["-6", "route", "replace", dest, "via", "fe80::1", "dev", dev, *m],
        ]
    if ipv4:
        cmds += [["-4", "addr", "add", f"{ipv4}/32", "dev", dev],
                 ["-4", "route", "replace", "169.254.0.1", "dev", dev, "scope", "link"],
                 ["-4", "route", "replace", "default", "via", "169.254.0.1", "dev", dev,
                  "onlink"]]  # fmt: skip
    return cmds


def by_ip(ns: Netns, config: list[Any]) -> None:
    for cmd in reference("d0", *config):
        if cmd[0] == "-":
            ns.run("ip", *cmd[1:], check=False)
        else:
            ns.run("ip", *cmd)


def by_netlink(ns: Netns, config: list[Any]) -> Any:
    return json.loads(ns.run(sys.executable, "-c", APPLY, json.dumps(["d0", *config])).stdout)


def state(ns: Netns) -> dict[str, Any]:
    """What matters of d0 and lo: flags, MTU, addresses, and every route of d0 in every table."""
    links = {
        link["ifname"]: (sorted(link["flags"]), link["mtu"])
        for link in json.loads(ns.run("ip", "-j", "link", "show").stdout)
    }
    addrs = json.loads(ns.run("ip", "-j", "addr", "show", "dev", "d0").stdout)[0]["addr_info"]
    keep = ("family", "local", "prefixlen", "scope", "nodad", "noprefixroute")
    routes = {}
    for family in ("-4", "-6"):
        shown = ns.run("ip", "-j", family, "route", "show", "table", "all", "dev", "d0").stdout
        routes[family] = sorted(json.dumps(r, sort_keys=True) for r in json.loads(shown))
    return {
        "links": links,
        "addrs": sorted(json.dumps({k: a.get(k) for k in keep}, sort_keys=True) for a in addrs),
        "routes": routes,
    }


def settled(ns: Netns, ref: Netns, within: float = 3.0) -> dict[str, Any]:
    """The namespace's state once it matches the reference's or `within` s passed: the kernel
    finishes some changes after netlink's answer (a link's routes after it goes up, on 6.18),
    for ip's namespace as for ours."""
    deadline = time.monotonic() + within
    while True:
        got = state(ns)
        if got == state(ref) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture
def pair(make_netns: Callable[[str], Netns]) -> tuple[Netns, Netns]:
    """Two namespaces alike: the reference's and netlink's."""
    made = []
    for prefix in ("nlref", "nl"):
        ns = make_netns(prefix)
        ns.run("ip", "link", "set", "lo", "down")  # the configuration sets it up
        ns.run("ip", "link", "add", "d0", "address", MAC, "type", "veth", "peer", "name", "d1")
        ns.run("ip", "link", "set", "d1", "up")
        ns.run("sysctl", "-qw", "net.ipv6.conf.d0.accept_ra=0")
        made.append(ns)
    return made[0], made[1]


CONFIGS = [
    ["fd00:1::5", True, "169.254.16.5", 1420],
    ["2001:db8::5", False, "", 0],
    ["2001:db8::6", False, "169.254.16.6", 1500],
    ["", False, "169.254.16.7", 0],
    ["fd00:1::8", True, "", 9000],
]


def test_each_configuration_replaces_the_last_as_ip_did(pair: tuple[Netns, Netns]) -> None:
    ref, ns = pair
    for config in CONFIGS:
        by_ip(ref, config)
        assert by_netlink(ns, config) is None
        got = settled(ns, ref)
        assert got == state(ref), config
        ipv6, _ula, ipv4, _mtu = config
        addrs = "".join(got["addrs"])
        assert (ipv6 in addrs) and (ipv4 in addrs)
    assert "fd00:1::5" not in "".join(got["addrs"]) + "".join(got["routes"]["-6"])
    assert "169.254.16.7" not in "".join(got["addrs"])


def test_what_was_there_before_is_flushed_as_ip_did(pair: tuple[Netns, Netns]) -> None:
    """Addresses and routes of every kind on the device, and more addresses than one datagram
    of a dump holds: what ip(8) flushed is flushed, what it kept is kept (the kernel itself
    drops the other tables' IPv4 routes of the device with its last IPv4 address)."""
    script = ["-4 addr add 10.1.0.1/24 dev d0", "-4 addr add 10.1.0.2/24 dev d0",
              "-6 addr add 2001:db8:1::1/64 dev d0 nodad", "-6 addr add fd00:9::1/64 dev d0 nodad",
              "-4 route add 10.9.0.0/16 via 10.1.0.254 dev d0",
              "-4 route add 10.8.0.0/16 dev d0 table 100",
              "-6 route add 2001:db8:9::/48 via fe80::9 dev d0",
              "-6 route add default via fe80::2 dev d0 metric 5"]  # fmt: skip
    script += [f"-4 addr add 10.2.{i // 250}.{i % 250 + 1}/32 dev d0" for i in range(400)]
    for ns in pair:
        ns.run("ip", "link", "set", "d0", "up")
        ns.run("ip", "-batch", "-", input="".join(line[3:] + "\n" for line in script))
    ref, ns = pair
    by_ip(ref, CONFIGS[0])
    assert by_netlink(ns, CONFIGS[0]) is None
    got = state(ns)
    assert got == state(ref)
    assert not any("10.2." in a for a in got["addrs"])
    assert not any("2001:db8:1::1" in a or "fd00:9::1" in a for a in got["addrs"])
    assert any('"scope": "link"' in a for a in got["addrs"])  # only the global ones go
    assert any("2001:db8:9::/48" in r for r in got["routes"]["-6"])  # ip kept it: kept


def test_an_error_names_the_step_and_the_errno(pair: tuple[Netns, Netns]) -> None:
    _ref, ns = pair
    ns.run("sysctl", "-qw", "net.ipv6.conf.d0.disable_ipv6=1")
    code, message = by_netlink(ns, CONFIGS[0])
    assert code == "INTERNAL"
    assert message.startswith("netlink: add fd00:1::5/128: Permission denied (EACCES)"), message
    assert by_netlink(ns, ["", False, "169.254.16.7", 0]) is None  # IPv4 alone still goes
    code, message = json.loads(
        ns.run(sys.executable, "-c", APPLY, json.dumps(["nosuch0", "", False, "", 0])).stdout
    )
    assert (code, message) == ("FAILED_PRECONDITION", "no network device nosuch0")
