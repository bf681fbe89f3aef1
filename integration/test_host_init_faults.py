"""The node image on a poor network (one boot for the module): no DHCPv6 server, a DHCPv4 lease
of 30 s whose server goes away and comes back, an NTP server that never answers, a bad
`feos.pod-prefix=` on the kernel's command line. Each is logged and lived with as the spec says,
and feosd is reachable as soon as the node has an address and feosd runs."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from hostnet import ROUTER4, Servers, sh
from nodevm import NodeVM, node_image
from test_host_init import BOOT_S, answered, lease

pytestmark = [pytest.mark.integration]

BAD_PREFIX = "10.0.0.0/8"


def poor_network(s: Servers) -> None:
    s.dhcp4(lease_s=30, renew_s=10)
    s.radvd()
    # NTP at the router never answers: its packets are dropped, not refused.
    sh(s.netns, "nft", "add table inet hi; add chain inet hi in { type filter hook input priority 0; }; "
       "add rule inet hi in udp dport 123 drop")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeVM]:
    image = node_image()
    with NodeVM.boot(image, tmp_path_factory.mktemp("node"), setup=poor_network,
                     cmdline=[f"feos.pod-prefix={BAD_PREFIX}"]) as vm:
        vm.wait_console(r"started feosd \(pid \d+\)", BOOT_S)
        yield vm


def test_bad_prefix_logged_and_ignored(node: NodeVM) -> None:
    node.wait_console(rf"feos.pod-prefix={re.escape(BAD_PREFIX)}: .*: ignored", 10)


def test_no_dhcpv6_feosd_starts_without_a_prefix_after_30s(node: NodeVM) -> None:
    node.wait_console(r"no pod prefix within 30 s: feosd starts without one", 10)
    started = node.wait_console(r"started feosd \(pid \d+\): ([^\n]*)", 10).group(1)
    assert "--pod-prefix" not in started
    assert "DHCPv6: address" not in node.console()


def test_reachable_over_ipv4_alone(node: NodeVM) -> None:
    v4 = lease(node, 4)
    assert answered(node, v4)


def test_ntp_that_never_answers(node: NodeVM) -> None:
    node.wait_console(rf"NTP: {re.escape(ROUTER4)} \(IPv4\): no answer in 5 s", 120)
    node.wait_console(r"NTP: no server answered; the clock stays as it is", 120)


def test_lease_that_ends_is_asked_again(node: NodeVM) -> None:
    v4 = lease(node, 4)
    node.servers.stop("kea4")
    mark = len(node.console())
    node.wait_console(rf"DHCPv4: the lease of {re.escape(v4)}/\d+ ended; asking again", 90, mark)
    time.sleep(5)  # DISCOVERs into the void for a while
    node.servers.dhcp4(lease_s=30, renew_s=10)
    assert lease(node, 4, mark)
