"""feos-host-init's one event loop (asyncio: pyroute2's DHCPv4 client is asyncio), which keeps
the node once the start (_main) set the machine up.

Theory of operation. diskd once the node's own modules are in, the devices' modules
(coldplug) beside the rest; the uplink as soon as its device is there (RA, DHCPv4, DHCPv6) and
as servers answer, each lease written to the link, resolv.conf and the NTP servers as they
change; feosd once its pod prefix is known (the command line's at once, else DHCPv6's
delegation, or none once DHCPv6 had its 30 seconds), and again with the new prefix if a later
delegation brings one; the clock once both DHCPs had their chance and every quarter of an hour;
the power signals.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
from pathlib import Path

from feos.errors import FeosError

from . import _link, _ntp, _system
from ._dhcp6 import Dhcp6Client, Lease6
from ._plan import (
    DHCP6_WAIT_S,
    TCP_CERT,
    TCP_CLIENT_CA,
    TCP_KEY,
    cmdline_pod_prefix,
    lease4_routes,
    ntp_order,
    pod_prefix_after_delegation,
    resolv_conf,
    tcp_options,
)
from ._supervise import Program, Supervisor

log = logging.getLogger("feos.hostinit")

UPLINK = "eth0"
NTP_EVERY_S = 900.0
STOP_GRACE_S = 10.0
LINK_WAIT_S = 10.0
DISKD = ["/usr/sbin/diskd", "--state-dir", "/var/lib/feos/disk"]
FEOSD = ["/usr/sbin/feosd", "--self-upgrade"]  # and tcp_options's


def run(cmdline: str, dns: list[socket.socket], loading: _system.Loading | None) -> None:
    asyncio.run(Node(cmdline, dns).run(loading))


def _ignored(sig: int) -> None:
    log.info("%s ignored", signal.Signals(sig).name)


class Node:
    def __init__(self, cmdline: str, dns: list[socket.socket]) -> None:
        self._cmdline = cmdline
        self._tcp_said = ""  # the console's last line about the API on TCP
        self._dns = dns
        self._dns6: list[ipaddress.IPv6Address] = []
        self._dns4: list[ipaddress.IPv4Address] = []
        self._ntp6: list[ipaddress.IPv6Address | str] = []
        self._ntp4: list[ipaddress.IPv4Address] = []
        self._address4: ipaddress.IPv4Interface | None = None
        self._address6: ipaddress.IPv6Address | None = None
        self._delegated: ipaddress.IPv6Network | None = None
        self._pod_prefix: ipaddress.IPv6Network | None = None
        self._fixed_prefix = False
        self._prefix_known = asyncio.Event()
        self._dhcp4_done = asyncio.Event()
        self._ntp_due = asyncio.Event()
        self._coldplugged = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, loading: _system.Loading | None) -> None:
        loop = asyncio.get_running_loop()
        self._sup = Supervisor(self._dns, _system.program_output())
        self._sup.install()
        powers = (
            (signal.SIGINT, _system.RB_AUTOBOOT, "Ctrl-Alt-Del: syncing and rebooting"),
            (signal.SIGRTMIN + 5, _system.RB_AUTOBOOT, "SIGRTMIN+5: rebooting"),
            (signal.SIGRTMIN + 4, _system.RB_POWER_OFF, "SIGRTMIN+4: powering off"),
        )
        for sig, cmd, why in powers:
            loop.add_signal_handler(sig, self._spawn_power, cmd, why)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            loop.add_signal_handler(sig, _ignored, sig)
        await asyncio.to_thread(_system.wait_modules, loading)
        self._sup.add(Program("diskd", lambda: list(DISKD)))
        self._spawn(self._coldplug())
        self._take_cmdline_prefix()
        self._spawn(self._start_feosd())
        await self._uplink()
        self._spawn(self._keep_clock())
        await asyncio.Event().wait()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a task of host-init failed: %r", task.exception())

    def _spawn_power(self, cmd: int, why: str) -> None:
        self._spawn(self._power(cmd, why))

    async def _power(self, cmd: int, why: str) -> None:
        log.warning("%s", why)
        await self._sup.stop(STOP_GRACE_S)
        os.sync()
        _system.reboot(cmd)

    # The pod prefix and feosd.

    def _take_cmdline_prefix(self) -> None:
        try:
            prefix = cmdline_pod_prefix(self._cmdline)
        except FeosError as exc:
            log.error("%s: ignored; the pods take DHCPv6's delegated prefix, if any", exc.message)
            return
        if prefix is not None:
            log.info("pod prefix %s from the kernel's command line", prefix)
            self._pod_prefix, self._fixed_prefix = prefix, True
            self._prefix_known.set()

    def _feosd_argv(self) -> list[str]:
        prefix = [] if self._pod_prefix is None else ["--pod-prefix", str(self._pod_prefix)]
        files = [p for p in (TCP_CLIENT_CA, TCP_CERT, TCP_KEY) if os.path.exists(p)]
        tcp, said = tcp_options(files, self._cmdline)
        if said != self._tcp_said:
            (log.info if tcp and "--tcp-insecure" not in tcp else log.warning)(said)
            self._tcp_said = said
        return [*FEOSD, *tcp, *prefix]

    async def _start_feosd(self) -> None:
        try:
            await asyncio.wait_for(self._prefix_known.wait(), DHCP6_WAIT_S)
        except TimeoutError:
            log.warning("no pod prefix within %.0f s: feosd starts without one", DHCP6_WAIT_S)
        self._sup.add(Program("feosd", self._feosd_argv, dns=True))

    async def _delegated_prefix(self, prefix: ipaddress.IPv6Network | None) -> None:
        if prefix == self._delegated:
            return
        if self._delegated is not None:
            await _link.route_unreachable(self._delegated, add=False)
        self._delegated = prefix
        if prefix is not None:
            await _link.route_unreachable(prefix)
            log.info("DHCPv6: delegated prefix %s, routed as unreachable", prefix)
        self._pod_prefix, again = pod_prefix_after_delegation(
            self._pod_prefix, prefix, self._fixed_prefix
        )
        self._prefix_known.set()
        if again and self._sup.pid("feosd") is not None:
            log.warning("a new delegated prefix: feosd starts again with --pod-prefix %s", prefix)
            self._sup.restart("feosd")

    # The uplink.

    async def _coldplug(self) -> None:
        try:
            modules = await asyncio.to_thread(_system.coldplug)
        except OSError as exc:
            log.error("modules: %s", exc)
            modules = []
        finally:
            self._coldplugged.set()
        log.info("modules loaded: %s", " ".join(modules) or "none")

    async def _wait_for_uplink(self) -> bool:
        """eth0, once its driver is in: the node's own list has virtio_net, coldplug a real
        machine's NIC driver; LINK_WAIT_S more after coldplug ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINK_WAIT_S
        while not _system.has_link(UPLINK):
            if not self._coldplugged.is_set():
                deadline = loop.time() + LINK_WAIT_S
            elif loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _uplink(self) -> None:
        await _link.up("lo")
        if not await self._wait_for_uplink():
            log.error("no uplink %s: the node has no network", UPLINK)
            self._dhcp4_done.set()
            self._prefix_known.set()
            return
        log.info("%s", _system.configure_sriov(UPLINK))
        for path, value in (
            (f"/proc/sys/net/ipv6/conf/{UPLINK}/accept_ra", "2"),
            (f"/proc/sys/net/ipv6/conf/{UPLINK}/autoconf", "1"),
            # RFC 4429: the link-local address serves DHCPv6 while DAD runs, not a second later
            (f"/proc/sys/net/ipv6/conf/{UPLINK}/optimistic_dad", "1"),
            (f"/proc/sys/net/ipv6/conf/{UPLINK}/use_optimistic", "1"),
            ("/proc/sys/net/ipv6/conf/all/forwarding", "1"),
            ("/proc/sys/net/ipv4/ip_forward", "1"),
        ):
            _system.write(path, value)
        await _link.up(UPLINK)
        self._spawn(self._dhcp4())
        self._spawn(self._dhcp6())

    def _resolvers(self) -> None:
        if self._dns6 or self._dns4:
            Path("/etc/resolv.conf").write_text(resolv_conf(self._dns6, self._dns4))
            log.info("resolv.conf: %s", " ".join(map(str, [*self._dns6, *self._dns4])))

    async def _dhcp6(self) -> None:
        mac = _system.mac_of(UPLINK)
        while True:
            try:
                client = Dhcp6Client(UPLINK, mac, self._on_lease6)
                try:
                    await client.run()
                finally:
                    client.close()
            except OSError as exc:
                log.error("DHCPv6: %s; starting again in 1 s", exc)
                await asyncio.sleep(1.0)

    async def _on_lease6(self, lease: Lease6 | None) -> None:
        address = None if lease is None or lease.address is None else lease.address
        if self._address6 is not None and self._address6 != (address and address.address):
            await _link.remove_address(UPLINK, ipaddress.IPv6Interface(f"{self._address6}/128"))
        if address is not None:
            await _link.set_address6(UPLINK, address.address, address.preferred, address.valid)
            log.info("DHCPv6: address %s on %s", address.address, UPLINK)
        self._address6 = None if address is None else address.address
        if lease is not None and lease.prefix is None:
            log.warning("DHCPv6: no delegated prefix")
        await self._delegated_prefix(
            None if lease is None or lease.prefix is None else lease.prefix.prefix
        )
        self._dns6 = [] if lease is None else list(lease.dns)
        self._ntp6 = [] if lease is None else list(lease.ntp)
        self._resolvers()
        self._prefix_known.set()
        self._ntp_due.set()

    async def _dhcp4(self) -> None:
        from ._dhcp4 import run_client

        while True:
            try:
                await run_client(UPLINK, self._on_lease4, self._off_lease4)
            except OSError as exc:
                log.error("DHCPv4: %s; starting again in 1 s", exc)
                await asyncio.sleep(1.0)

    async def _on_lease4(
        self,
        address: ipaddress.IPv4Interface,
        routers: list[ipaddress.IPv4Address],
        dns: list[ipaddress.IPv4Address],
        ntp: list[ipaddress.IPv4Address],
    ) -> None:
        if self._address4 not in (None, address):
            await _link.remove_address(UPLINK, self._address4)
        routes = lease4_routes(address, routers)
        await _link.set_address4(UPLINK, address, routes)
        self._address4 = address
        via = f", default route by {routers[0]}" if routers else ", no router"
        log.info("DHCPv4: address %s on %s%s", address, UPLINK, via)
        self._dns4, self._ntp4 = dns, ntp
        self._resolvers()
        self._dhcp4_done.set()
        self._ntp_due.set()

    async def _off_lease4(self) -> None:
        if self._address4 is not None:
            log.warning("DHCPv4: the lease of %s ended; asking again", self._address4)
            await _link.remove_address(UPLINK, self._address4)
            self._address4 = None

    # The clock.

    async def _keep_clock(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DHCP6_WAIT_S
        for event in (self._prefix_known, self._dhcp4_done):
            try:
                await asyncio.wait_for(event.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass
        while True:
            self._ntp_due.clear()
            await _ntp.sync_once(ntp_order(self._ntp6, self._ntp4))
            try:
                await asyncio.wait_for(self._ntp_due.wait(), NTP_EVERY_S)
            except TimeoutError:
                pass
