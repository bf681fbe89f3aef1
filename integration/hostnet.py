"""A node's network in a namespace of the test's own: Debian's kea (DHCPv4, and DHCPv6 with
prefix delegation), radvd (router advertisements) and chrony (NTP), all on one link.

`Servers(netns, ifname, workdir)` writes their configuration and starts each (OWNER.popen: they
end with the harness); the addresses below are the network's. chrony runs with -x: it serves
time from the host's clock and never sets it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _owner import OWNER

ROUTER4 = "10.77.0.1"
PREFIX4 = "10.77.0.0/24"
POOL4 = ("10.77.0.100", "10.77.0.150")
ROUTER6 = "2001:db8:77::1"
PREFIX6 = "2001:db8:77::/64"
POOL6 = ("2001:db8:77::100", "2001:db8:77::1ff")
PD_POOL = ("2001:db8:7700::", 40, 56)
# the link comes up when the node's side does (a TAP once QEMU opens it): kea waits for it
RETRY = {"service-sockets-max-retries": 600, "service-sockets-retry-wait-time": 500}


def ns(netns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv]


def sh(netns: str, *argv: str) -> None:
    subprocess.run(ns(netns, *argv), check=True)


class Servers:
    def __init__(self, netns: str, ifname: str, workdir: Path) -> None:
        self.netns, self.ifname, self.dir = netns, ifname, workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def address(self) -> None:
        """The router's addresses on the link (nodad: the servers bind at once)."""
        sh(self.netns, "ip", "link", "set", self.ifname, "up")
        sh(self.netns, "ip", "addr", "add", f"{ROUTER4}/24", "dev", self.ifname)
        sh(self.netns, "ip", "-6", "addr", "add", f"{ROUTER6}/64", "dev", self.ifname, "nodad")
        sh(self.netns, "ip", "-6", "addr", "add", "fe80::1/64", "dev", self.ifname, "nodad")
        sh(self.netns, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")

    def _start(self, name: str, argv: list[str]) -> None:
        env = {"KEA_LOCKFILE_DIR": str(self.dir), "KEA_PIDFILE_DIR": str(self.dir),
               "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        with (self.dir / f"{name}.log").open("wb") as log:
            self.procs[name] = OWNER.popen(ns(self.netns, *argv), stdout=log, stderr=log, env=env)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.terminate()
            proc.wait(10)

    def dhcp4(self, lease_s: int = 600, renew_s: int | None = None) -> None:
        conf = {"Dhcp4": {
            "interfaces-config": {"interfaces": [self.ifname], "dhcp-socket-type": "raw",
                                  **RETRY},
            "lease-database": {"type": "memfile", "persist": False},
            "valid-lifetime": lease_s, "renew-timer": renew_s or lease_s // 2,
            "rebind-timer": (renew_s or lease_s // 2) * 7 // 4,
            "subnet4": [{"id": 1, "subnet": PREFIX4, "pools": [{"pool": " - ".join(POOL4)}],
                         "option-data": [{"name": "routers", "data": ROUTER4},
                                         {"name": "domain-name-servers", "data": ROUTER4},
                                         {"name": "ntp-servers", "data": ROUTER4}]}],
            "loggers": [{"name": "kea-dhcp4", "output_options": [{"output": "stdout"}],
                         "severity": "INFO"}],
        }}
        path = self.dir / "kea4.json"
        path.write_text(json.dumps(conf))
        self._start("kea4", ["kea-dhcp4", "-c", str(path)])

    def dhcp6(self, pd: bool = True, lease_s: int = 600) -> None:
        subnet: dict[str, object] = {
            "id": 1, "subnet": PREFIX6, "interface": self.ifname,
            "pools": [{"pool": "-".join(POOL6)}],
            "option-data": [{"name": "dns-servers", "data": ROUTER6},
                            {"name": "sntp-servers", "data": ROUTER6}],
        }
        if pd:
            subnet["pd-pools"] = [{"prefix": PD_POOL[0], "prefix-len": PD_POOL[1],
                                   "delegated-len": PD_POOL[2]}]
        conf = {"Dhcp6": {
            "interfaces-config": {"interfaces": [self.ifname], **RETRY},
            "server-id": {"type": "EN", "enterprise-id": 2495, "identifier": "feed0077",
                          "persist": False},
            "data-directory": str(self.dir),
            "lease-database": {"type": "memfile", "persist": False},
            "preferred-lifetime": lease_s // 2, "valid-lifetime": lease_s,
            "renew-timer": lease_s // 4, "rebind-timer": lease_s // 3,
            "subnet6": [subnet],
            "loggers": [{"name": "kea-dhcp6", "output_options": [{"output": "stdout"}],
                         "severity": "INFO"}],
        }}
        path = self.dir / "kea6.json"
        path.write_text(json.dumps(conf))
        self._start("kea6", ["kea-dhcp6", "-c", str(path)])

    def radvd(self) -> None:
        path = self.dir / "radvd.conf"
        path.write_text(
            f"interface {self.ifname} {{ AdvSendAdvert on; MinRtrAdvInterval 3; "
            f"MaxRtrAdvInterval 10; AdvManagedFlag on; AdvOtherConfigFlag on; "
            f"prefix {PREFIX6} {{ AdvOnLink on; AdvAutonomous on; }}; }};\n"
        )
        self._start("radvd", ["radvd", "-n", "-C", str(path), "-p", str(self.dir / "radvd.pid"),
                              "-m", "stderr"])

    def chrony(self) -> None:
        path = self.dir / "chrony.conf"
        path.write_text(
            "local stratum 8\nallow all\ncmdport 0\n"
            f"pidfile {self.dir / 'chronyd.pid'}\n"
        )
        self._start("chrony", ["chronyd", "-d", "-x", "-f", str(path)])

    def all(self, pd: bool = True) -> None:
        self.address()
        self.dhcp4()
        self.dhcp6(pd=pd)
        self.radvd()
        self.chrony()
