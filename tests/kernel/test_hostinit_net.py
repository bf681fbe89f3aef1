"""feos-host-init's uplink against Debian's real servers (kea's DHCPv4 and DHCPv6 with prefix
delegation, radvd, chrony) in throwaway namespaces: a veth pair, the servers on one end, the
node's clients (its own code, tests/kernel/_hostinit_probe.py) on the other."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _owner import OWNER
from hostnet import PD_POOL, POOL4, PREFIX6, ROUTER4, ROUTER6, Servers

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    not all(shutil.which(p) for p in ("kea-dhcp4", "kea-dhcp6", "radvd", "chronyd")),
    reason="kea, radvd and chrony are Debian packages of hack/packages.apt",
)


@pytest.fixture
def link(tmp_path: Path) -> Iterator[tuple[Servers, str]]:
    tag = secrets.token_hex(3)
    srv, node = OWNER.netns(f"feostest-hi-s{tag}"), OWNER.netns(f"feostest-hi-n{tag}")
    subprocess.run(["ip", "link", "add", "hs0", "netns", srv, "type", "veth", "peer", "name",
                    "eth0", "netns", node], check=True)
    for ns in (srv, node):
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    servers = Servers(srv, "hs0", tmp_path)
    try:
        yield servers, node
    finally:
        for name in list(servers.procs):
            servers.stop(name)
        OWNER.done(node)
        OWNER.done(srv)


def probe(node: str, wait6: float = 40.0) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    done = subprocess.run(["ip", "netns", "exec", node, sys.executable, str(HERE / "_hostinit_probe.py"),
                           "eth0", str(wait6)], capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_uplink_from_kea_radvd_chrony(link: tuple[Servers, str]) -> None:
    servers, node = link
    servers.all(pd=True)
    out = probe(node)
    v4 = out["v4"]
    assert v4["address"].split("/")[0].startswith(POOL4[0].rsplit(".", 1)[0] + ".")  # type: ignore[index]
    assert v4["address"].endswith("/24") and v4["routers"] == [ROUTER4] and v4["dns"] == [ROUTER4]  # type: ignore[index]
    v6 = out["v6"]
    assert v6["prefix"].startswith(PD_POOL[0].rstrip(":")) and v6["prefix"].endswith(f"/{PD_POOL[2]}")  # type: ignore[index]
    assert v6["address"].startswith(PREFIX6.split("::")[0]) and v6["dns"] == [ROUTER6]  # type: ignore[index]
    assert f"{v6['address']}/128" in out["addresses"]  # type: ignore[index,operator]
    hosts = [(h, f) for h, f, _ in out["ntp"]]  # type: ignore[union-attr,misc]
    assert hosts == [(ROUTER6, 6), (ROUTER4, 4)]  # DHCPv6's first, then DHCPv4's, both answered
    routes = subprocess.run(["ip", "-n", node, "-6", "route", "show", "type", "unreachable"],
                            capture_output=True, text=True, check=True).stdout
    assert v6["prefix"] in routes  # type: ignore[index]
    v4routes = subprocess.run(["ip", "-n", node, "route"], capture_output=True, text=True, check=True).stdout
    assert f"default via {ROUTER4} dev eth0" in v4routes


def test_dhcpv6_without_prefix_delegation_gives_the_address(link: tuple[Servers, str]) -> None:
    servers, node = link
    servers.address()
    servers.dhcp4()
    servers.dhcp6(pd=False)
    servers.radvd()
    servers.chrony()
    out = probe(node)
    v6 = out["v6"]
    assert v6["prefix"] is None and v6["address"].startswith(PREFIX6.split("::")[0])  # type: ignore[index]


def test_no_dhcpv6_server_leaves_dhcpv4(link: tuple[Servers, str]) -> None:
    servers, node = link
    servers.address()
    servers.dhcp4()
    servers.chrony()
    out = probe(node, wait6=5.0)
    assert out["v6"] is None and out["v4"]["routers"] == [ROUTER4]  # type: ignore[index]
    assert [(h, f) for h, f, _ in out["ntp"]] == [(ROUTER4, 4)]  # type: ignore[union-attr,misc]
