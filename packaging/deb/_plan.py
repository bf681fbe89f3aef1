"""The pure decisions of the Debian packages' build: versions, the package table, control files.

build.py does the work (pip, dpkg-deb, copies); what it builds is decided here, so that the
tests check the versions' order, the dependencies and the control files without building
anything (tests/unit/test_deb_plan.py). Standard library only: build.py runs on a bare python3.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

# The distributions built for: the suite an apt line names, the Python and systemd they ship.
# Debian 13 is the repository's stable; Debian 12 is oldstable.


@dataclass(frozen=True)
class Dist:
    codename: str
    suite: str
    tag: str  # the version suffix: the same upstream version, one build per distribution
    python: str  # the distribution's python3, which the vendored wheels are for
    systemd: int

    @property
    def python_tag(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def delegate_subgroup(self) -> bool:
        return self.systemd >= 254  # DelegateSubgroup= is systemd 254's


DISTS = {
    "bookworm": Dist("bookworm", "oldstable", "deb12", "3.11", 252),
    "trixie": Dist("trixie", "stable", "deb13", "3.13", 257),
}

_UPSTREAM = re.compile(r"^[0-9][0-9A-Za-z.+~]*$")


def dev_version(upstream: str, when: float, commit: str) -> str:
    """The version of a build of a commit that is not a release: below the release it leads to
    (pyproject's version is the next release) and above every earlier build, ordered by its UTC
    time: 0.1.0~dev.20261202041300.62ebe48 < 0.1.0~dev.20261202051500.0ab12cd < 0.1.0."""
    check_upstream(upstream)
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        raise ValueError(f"not a commit hash: {commit!r}")
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime(when))
    return f"{upstream}~dev.{stamp}.{commit[:12]}"


def check_upstream(upstream: str) -> str:
    if not _UPSTREAM.fullmatch(upstream):
        raise ValueError(f"not a Debian upstream version: {upstream!r}")
    return upstream


def dist_version(upstream: str, dist: Dist) -> str:
    """The version of one distribution's build: +deb12 and +deb13 keep both in one pool."""
    return f"{upstream}+{dist.tag}"


def firecracker_version(directory: str) -> str:
    """Firecracker's directory name (v1.12.1) as a version (1.12.1)."""
    return check_upstream(directory.removeprefix("v"))


def guest_package(guest: str) -> str:
    return f"feos-guest-{guest}"


def firecracker_package(directory: str) -> str:
    return f"feos-firecracker-{directory.lower()}"


@dataclass
class Package:
    """One binary package: its control fields and what build.py puts into it."""

    name: str
    version: str
    description: str
    architecture: str = "amd64"
    depends: list[str] = field(default_factory=list)
    recommends: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    conffiles: list[str] = field(default_factory=list)
    section: str = "admin"
    priority: str = "optional"


MAINTAINER = "feos maintainers <feos@fecode.dev>"


def packages(version: str, dist: Dist, *, guest: str, firecracker: str,
             guest_build: str) -> list[Package]:
    """The packages of one build. `version` is the build's upstream version, `guest` the guest
    image's version (its hash), `firecracker` Firecracker's directory (v1.12.1), `guest_build`
    the guest package's version (the time it was built, so that a newer guest sorts higher)."""
    v = dist_version(version, dist)
    py = dist.python
    nxt = f"{py.split('.')[0]}.{int(py.split('.')[1]) + 1}"
    same = f"(= {v})"
    fc_pkg, guest_pkg = firecracker_package(firecracker), guest_package(guest)
    fc_version = firecracker_version(firecracker)
    return [
        Package("feos-python", v,
                "feos's Python package and the libraries it uses, for Debian's python3\n"
                f" /usr/lib/feos/python: feos and its dependencies as wheels for Python {py},"
                "\n installed as they are: nothing comes from pip or the network.",
                depends=[f"python3 (>= {py})", f"python3 (<< {nxt})", "libc6",
                         "libnghttp2-14"],  # feos._nghttp2: the node connections' HTTP/2
                section="python"),
        Package("feosd", v,
                "the feos node agent: pods as microVMs\n"
                " feosd runs pods as microVMs (Firecracker, or QEMU where that is what the\n"
                " machine can run), with feosd.socket holding the pods' resolver.",
                # at least the guest and Firecracker it was built with: an upgrade of feosd
                # brings them (apt-get install feosd alone would not upgrade an unversioned one)
                depends=[f"feos-python {same}", f"diskd {same}",
                         f"feos-firecracker (>= {fc_version})", f"feos-guest (>= {guest_build})",
                         "qemu-system-x86", "iproute2", "libnftables1",
                         "init-system-helpers (>= 1.54~)", "systemd"],
                recommends=[f"feosctl {same}"],
                conffiles=["/etc/default/feosd", "/etc/apt/apt.conf.d/50feosd"]),
        Package("feosctl", v, "the feos node agent's command line client",
                depends=[f"feos-python {same}"]),
        Package("diskd", v,
                "the pods' disks of the feos node agent\n"
                " diskd serves the pods' disks (qcow2 tops over shared bases) and keeps them"
                "\n in an object store.",
                depends=[f"feos-python {same}", "qemu-utils", "qemu-system-common", "fuse3",
                         "zstd", "e2fsprogs", "kmod", "init-system-helpers (>= 1.54~)",
                         "systemd"],
                conffiles=["/etc/default/diskd"]),
        Package(fc_pkg, fc_version,
                f"Firecracker {firecracker} and its jailer for feosd\n"
                f" /usr/lib/feos/firecracker/{firecracker}: installed beside other versions,"
                "\n which the pods booted with them keep using."),
        Package("feos-firecracker", fc_version,
                "the newest Firecracker for feosd (depends on it)",
                depends=[f"{fc_pkg} (= {fc_version})"]),
        Package(guest_pkg, guest_build,
                f"the feos guest image {guest}\n"
                f" /usr/lib/feos/guest/{guest}: installed beside other versions, which the"
                "\n pods booted with them keep using."),
        Package("feos-guest", guest_build,
                "the newest feos guest image (depends on it)",
                depends=[f"{guest_pkg} (= {guest_build})"]),
    ]


def control(pkg: Package, installed_kib: int) -> str:
    """The DEBIAN/control file of a package."""
    summary, _, long = pkg.description.partition("\n")
    lines = [
        f"Package: {pkg.name}",
        f"Version: {pkg.version}",
        f"Architecture: {pkg.architecture}",
        f"Maintainer: {MAINTAINER}",
        f"Installed-Size: {installed_kib}",
        f"Section: {pkg.section}",
        f"Priority: {pkg.priority}",
        "Homepage: https://apt.fecode.dev",
    ]
    for name, values in (("Depends", pkg.depends), ("Recommends", pkg.recommends),
                         ("Conflicts", pkg.conflicts)):
        if values:
            lines.append(f"{name}: {', '.join(values)}")
    lines.append(f"Description: {summary}")
    if long:
        lines.append(long)
    return "\n".join(lines) + "\n"


def unit_text(template: str, dist: Dist) -> str:
    """A unit file for a distribution: lines marked `#if-systemd>=N ` are kept (unmarked) where
    its systemd is at least N, else dropped (systemd 252 warns of an unknown DelegateSubgroup=)."""
    out = []
    for line in template.splitlines():
        m = re.match(r"#if-systemd>=(\d+) (.*)$", line)
        if m:
            if dist.systemd >= int(m.group(1)):
                out.append(m.group(2))
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def platforms(glibc_minor: int) -> list[str]:
    """The wheel platforms pip may take for a distribution whose glibc is 2.<glibc_minor>."""
    tags = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
    return tags + [f"manylinux_2_{n}_x86_64" for n in range(5, glibc_minor + 1)]


GLIBC = {"bookworm": 36, "trixie": 41}
