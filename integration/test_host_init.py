"""FeOS as the node's operating system: the node image (hack/host-image) booted under QEMU (TCG)
on a network of the test's own (kea's DHCPv4 and DHCPv6 with prefix delegation, radvd, chrony in
a namespace: integration/hostnet.py), feos-host-init as its PID 1. Everything is read from the
console, host-init's lines and diskd's and feosd's, which it relays as records of their own.

One QEMU for the module, its clock started in 2020 so that NTP has something to set, and a bad
`feos.pod-prefix=` on the kernel's command line. Its first boot is on a poor network: no DHCPv6
server, a DHCPv4 lease of 30 s whose server goes away and comes back, an NTP server that never
answers. Each fault is logged and lived with as the spec says, and feosd is reachable once the
node has an address and feosd runs. Then the network is mended (kea's DHCPv6 with prefix
delegation, a 10-minute DHCPv4 lease, chrony answering) and feosctl reboots the node (SIGRTMIN+5)
onto it: that boot gets its addresses, its prefix and its time, feosd is upgraded and killed, and
the power-off comes last. The tests run in the file's order (pytest's); each one selected alone
passes too (the fixtures `poor` and `node` bring the node to the boot it needs).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostnet import PD_POOL, POOL4, PREFIX6, ROUTER4, ROUTER6, Servers, sh
from nodevm import NodeVM, node_image

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parent.parent
BOOT_S = 600.0  # TCG: the kernel, a 400 MB initramfs, Python's start of feosd
FEOSD_LAUNCHER = (
    "#!/usr/bin/python3 -E\nimport sys\nsys.path.insert(0, '/usr/lib/feos/python')\n"
    "from feos.daemon import main\n\nmain()\n"
)
KMSG_TIME = r"\[\s*(\d+\.\d+)\]"
BAD_PREFIX = "10.0.0.0/8"
RTC_BASE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
NTP_DROP = "inet feos-test-ntp"


def poor_network(s: Servers) -> None:
    s.dhcp4(lease_s=30, renew_s=10)
    s.radvd()
    # NTP at the router never answers: its packets are dropped, not refused.
    sh(s.netns, "nft", f"add table {NTP_DROP}; add chain {NTP_DROP} in "
       "{ type filter hook input priority 0; }; "
       f"add rule {NTP_DROP} in udp dport 123 drop")


def mend_network(s: Servers) -> None:
    s.stop("kea4")
    s.dhcp4()
    s.dhcp6(pd=True)
    sh(s.netns, "nft", f"delete table {NTP_DROP}")
    s.chrony()


class Node:
    """The module's QEMU and the boot the `node` tests read: the one after the reboot onto the
    mended network (`at`: its offset in the console)."""

    def __init__(self, vm: NodeVM) -> None:
        self.vm = vm
        self.mended = False
        self.at = 0
        self.reboot_mark = 0  # the console's length when feosctl asked for the reboot
        self.before: dict[str, object] = {}  # host info on the poor boot


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    image = node_image()
    with NodeVM.boot(image, tmp_path_factory.mktemp("node"), setup=poor_network,
                     cmdline=[f"feos.pod-prefix={BAD_PREFIX}"], rtc_base="2020-01-01") as vm:
        vm.wait_console(r"started feosd \(pid \d+\)", BOOT_S)
        yield Node(vm)


@pytest.fixture
def poor(booted: Node) -> NodeVM:
    """The node on its first boot, on the poor network."""
    if booted.mended:
        pytest.fail("the poor network's tests run before the network is mended (file order)")
    return booted.vm


@pytest.fixture
def node(booted: Node) -> Node:
    """The node rebooted onto the mended network (once for the module)."""
    if not booted.mended:
        vm = booted.vm
        v4 = latest_lease(vm, 4)
        booted.before = info(answered(vm, v4))
        mend_network(vm.servers)
        booted.mended = True  # a reboot that fails is not tried again by the next test
        booted.reboot_mark = len(vm.console())
        power(vm, v4, "reboot")
        booted.at = vm.wait_console(r"Linux version", BOOT_S, booted.reboot_mark).start()
        vm.wait_console(r"started feosd \(pid \d+\)", BOOT_S, booted.at)
    return booted


def lease(vm: NodeVM, family: int, after: int = 0) -> str:
    pattern = r"DHCPv4: address (\S+)/\d+ on eth0" if family == 4 else r"DHCPv6: address (\S+) on eth0"
    return vm.wait_console(pattern, 120, after).group(1)


def latest_lease(vm: NodeVM, family: int) -> str:
    lease(vm, family)
    pattern = r"DHCPv4: address (\S+)/\d+ on eth0" if family == 4 else r"DHCPv6: address (\S+) on eth0"
    return re.findall(pattern, vm.console())[-1]  # type: ignore[no-any-return]


def feosctl(vm: NodeVM, address: str, *argv: str, timeout: float = 60.0) -> dict[str, object]:
    host = f"[{address}]" if ":" in address else address
    done = vm.ns("env", f"PYTHONPATH={REPO}", str(REPO / ".venv/bin/python"), "-c",
                 "from feos.cli import main; main()", "--json", "--socket", f"{host}:1337",
                 *vm.tls_flags, *argv,
                 timeout=timeout)
    assert done.returncode == 0, f"feosctl {' '.join(argv)}: {done.stderr[-2000:]}"
    return json.loads(done.stdout) if done.stdout.strip() else {}  # type: ignore[no-any-return]


def answered(vm: NodeVM, address: str, timeout: float = BOOT_S) -> dict[str, object]:
    """host info once feosd answers over TCP (it imports for a while under TCG)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return feosctl(vm, address, "host", "info", timeout=30)
        except (AssertionError, TimeoutError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def info(reply: dict[str, object]) -> dict[str, object]:
    return reply.get("info", reply)  # type: ignore[return-value]


def power(vm: NodeVM, address: str, verb: str) -> None:
    """feosctl host reboot|shutdown: its answer may not get out before feosd is stopped."""
    vm.ns("env", f"PYTHONPATH={REPO}", str(REPO / ".venv/bin/python"), "-c",
          "from feos.cli import main; main()", "--socket", f"{address}:1337", *vm.tls_flags,
          "host", verb)


# The first boot, on the poor network.


def test_bad_prefix_logged_and_ignored(poor: NodeVM) -> None:
    poor.wait_console(rf"feos.pod-prefix={re.escape(BAD_PREFIX)}: .*: ignored", 10)


def test_no_dhcpv6_feosd_starts_without_a_prefix_after_30s(poor: NodeVM) -> None:
    poor.wait_console(r"no pod prefix within 30 s: feosd starts without one", 10)
    started = poor.wait_console(r"started feosd \(pid \d+\): ([^\n]*)", 10).group(1)
    assert "--pod-prefix" not in started
    assert "DHCPv6: address" not in poor.console()


def test_reachable_over_ipv4_alone(poor: NodeVM) -> None:
    got = info(answered(poor, lease(poor, 4)))
    assert got["selfUpgrade"] is True
    poor.wait_console(r"feosd: .*the node has no pods' network: feosd was started without "
                      r"--pod-prefix", 10)


def test_ntp_that_never_answers(poor: NodeVM) -> None:
    poor.wait_console(rf"NTP: {re.escape(ROUTER4)} \(IPv4\): no answer in 5 s", 120)
    poor.wait_console(r"NTP: no server answered; the clock stays as it is", 120)


def test_lease_that_ends_is_asked_again(poor: NodeVM) -> None:
    v4 = latest_lease(poor, 4)
    poor.servers.stop("kea4")
    mark = len(poor.console())
    poor.wait_console(rf"DHCPv4: the lease of {re.escape(v4)}/\d+ ended; asking again", 90, mark)
    time.sleep(5)  # DISCOVERs into the void for a while
    poor.servers.dhcp4(lease_s=30, renew_s=10)
    assert lease(poor, 4, mark)


# The reboot onto the mended network, and that boot.


def test_reboot_by_sigrtmin5(node: Node) -> None:
    vm = node.vm
    said = vm.wait_console(r"SIGRTMIN\+5: rebooting", 10, node.reboot_mark).end()
    stopping = vm.console()[said:node.at]
    assert re.search(r"feos-host-init: feosd ended \(exit code 0\)", stopping), stopping
    assert re.search(r"feos-host-init: diskd ended \(exit code 0\)", stopping), stopping
    after = info(answered(vm, lease(vm, 4, node.at)))
    assert after["bootId"] != node.before["bootId"]


def test_addresses_prefix_resolvers_and_time(node: Node) -> None:
    vm, at = node.vm, node.at
    v4, v6 = lease(vm, 4, at), lease(vm, 6, at)
    assert ipaddress.IPv4Address(v4) in ipaddress.IPv4Network("10.77.0.0/24")
    assert ipaddress.IPv4Address(POOL4[0]) <= ipaddress.IPv4Address(v4)
    assert ipaddress.IPv6Address(v6) in ipaddress.IPv6Network(PREFIX6)
    prefix = vm.wait_console(r"DHCPv6: delegated prefix (\S+), routed as unreachable", 60,
                             at).group(1)
    assert ipaddress.IPv6Network(prefix).subnet_of(ipaddress.IPv6Network(f"{PD_POOL[0]}/{PD_POOL[1]}"))
    # the command line's bad prefix is ignored for the delegated one
    vm.wait_console(rf"started feosd \(pid \d+\): .*--tcp \[::\]:1337 --tcp-client-ca \S+ "
                    rf".*--pod-prefix {re.escape(prefix)}", 10, at)
    vm.wait_console(rf"resolv.conf: {re.escape(ROUTER6)} {re.escape(ROUTER4)}", 60, at)
    # QEMU's RTC started in 2020 and runs on: NTP by DHCPv6's server (the spec's first) moves
    # the node's clock by what QEMU's start was past 2020
    offset = float(vm.wait_console(rf"NTP: the clock set by {re.escape(ROUTER6)} \(IPv6\), "
                                   r"offset \+(\d+\.\d+) s", 180, at).group(1))
    started = time.time() - (time.monotonic() - vm.started)
    assert abs(offset - (started - RTC_BASE.timestamp())) < 60, offset
    for address in (v4, v6):  # feosd over TCP from the host's side, by either family
        got = info(answered(vm, address))
        assert got["selfUpgrade"] is True


def test_machine_setup_on_the_console(node: Node) -> None:
    vm, at = node.vm, node.at
    vm.wait_console(r"the root moved off the initramfs", 10, at)
    controllers = vm.wait_console(r"cgroup2 at /sys/fs/cgroup, controllers: ([^\n]*)", 10,
                                  at).group(1)
    assert {"cpu", "memory"} <= set(controllers.split()), controllers  # what vms/<id> needs
    modules = vm.wait_console(r"modules loaded: ([^\n]*)", 10, at).group(1).split()
    assert {"virtio_net", "nf_tables", "tun"} <= set(modules)
    vm.wait_console(r"eth0 offers no SR-IOV", 10, at)  # QEMU 7.2 emulates no SR-IOV device
    vm.wait_console(r"started diskd \(pid \d+\): /usr/sbin/diskd --state-dir /var/lib/feos/disk",
                    10, at)
    # diskd's and feosd's own lines, relayed by host-init as records of their own
    vm.wait_console(KMSG_TIME + r" diskd: \S+ \S+ diskd INFO diskd: serving on ", 60, at)
    vm.wait_console(KMSG_TIME + r" feosd: \S+ \S+ feosd INFO feosd: serving the API on ", 60, at)


def _upgrade(vm: NodeVM, address: str, program: str, tmp: Path) -> None:
    path = tmp / "feosd"
    path.write_text(program)
    feosctl(vm, address, "host", "upgrade", str(path),
            "--sha256", hashlib.sha256(program.encode()).hexdigest())


def test_self_upgrade_keeps_the_pid(node: Node, tmp_path: Path) -> None:
    vm = node.vm
    v4 = lease(vm, 4, node.at)
    before = info(answered(vm, v4))
    _upgrade(vm, v4, FEOSD_LAUNCHER, tmp_path)
    deadline = time.monotonic() + BOOT_S
    while True:
        after = info(answered(vm, v4))
        if after["startedUnixNs"] != before["startedUnixNs"]:
            break
        assert time.monotonic() < deadline
        time.sleep(2)
    assert after["pid"] == before["pid"]  # the same process, a new program


def test_killed_feosd_started_again_within_two_seconds(node: Node, tmp_path: Path) -> None:
    vm = node.vm
    v4 = lease(vm, 4, node.at)
    before = info(answered(vm, v4))
    mark = len(vm.console())
    # A program that puts the real feosd back and then dies of SIGKILL, as a crash would.
    killer = ("#!/bin/sh\ncat > /usr/sbin/.feosd.back <<'EOF'\n" + FEOSD_LAUNCHER + "EOF\n"
              "chmod 755 /usr/sbin/.feosd.back\nmv /usr/sbin/.feosd.back /usr/sbin/feosd\n"
              "kill -KILL $$\n")
    _upgrade(vm, v4, killer, tmp_path)
    ended = vm.wait_console(KMSG_TIME + r" feos-host-init: feosd ended \(killed by SIGKILL\): "
                            r"starting it again in 1 s", 120, mark)
    again = vm.wait_console(KMSG_TIME + r" feos-host-init: started feosd \(pid (\d+)\)", 60,
                            ended.end())
    # a second later, not at once (the supervisor's timer: no spinning on a crash loop); the
    # upper bound of two seconds is the kernel tier's (tests/kernel/test_hostinit_supervise.py),
    # a loaded TCG guest's clock is no judge of it
    assert float(again.group(1)) - float(ended.group(1)) >= 1.0
    deadline = time.monotonic() + BOOT_S
    while True:
        after = info(answered(vm, v4))
        if after["pid"] != before["pid"]:
            break
        assert time.monotonic() < deadline
        time.sleep(2)
    assert after["pid"] == int(again.group(2))


def test_shutdown_powers_off(node: Node) -> None:
    vm = node.vm
    v4 = lease(vm, 4, node.at)
    answered(vm, v4)
    mark = len(vm.console())
    power(vm, v4, "shutdown")
    vm.wait_console(r"SIGRTMIN\+4: powering off", 60, mark)
    assert vm.wait_exit(120) == 0


@pytest.mark.skip(reason="a pod inside the node is QEMU under QEMU, both TCG (the machine has no "
                  "hardware KVM, environment.md): the guest's 4 s boot takes tens of minutes "
                  "nested, beyond the suite's 30 minutes (the image carries no qemu-system-x86 for it)")
def test_pod_with_network_inside_the_node() -> None:
    raise AssertionError("skipped")
