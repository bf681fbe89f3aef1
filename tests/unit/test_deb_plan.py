"""packaging/deb/_plan.py: the Debian packages' versions, dependencies and control files."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

from _modpath import load

plan = load("feos_deb_plan", Path(__file__).resolve().parents[2] / "packaging/deb/_plan.py")

BOOKWORM, TRIXIE = plan.DISTS["bookworm"], plan.DISTS["trixie"]


def dpkg_lt(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "lt", b], check=False).returncode == 0


def test_dev_builds_sort_between_the_releases_and_by_time() -> None:
    first = plan.dev_version("0.2.0", 1_800_000_000, "62ebe48e82df0000")
    later = plan.dev_version("0.2.0", 1_800_000_060, "0000000aaaaaaaa")
    assert first == "0.2.0~dev.20270115080000.62ebe48e82df"
    order = ["0.1.0", first, later, "0.2.0", "0.2.1~dev.20270101000000.abcdef1"]
    for dist in (BOOKWORM, TRIXIE):
        versions = [plan.dist_version(v, dist) for v in order]
        for a, b in itertools.pairwise(versions):
            assert dpkg_lt(a, b), (a, b)


def test_a_bad_version_or_commit_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="not a Debian upstream version"):
        plan.check_upstream("v1 beta")
    with pytest.raises(ValueError, match="not a commit hash"):
        plan.dev_version("0.1.0", 0, "HEAD")


def test_packages_depend_as_the_spec_says() -> None:
    pkgs = {p.name: p for p in plan.packages("0.1.0", TRIXIE, guest="c50ac632ed49",
                                             firecracker="v1.12.1", guest_build="20261202022218")}
    assert set(pkgs) == {"feos-python", "feosd", "feosctl", "diskd", "feos-firecracker-v1.12.1",
                         "feos-firecracker", "feos-guest-c50ac632ed49", "feos-guest"}
    feosd = pkgs["feosd"].depends
    assert "diskd (= 0.1.0+deb13)" in feosd and "feos-firecracker (>= 1.12.1)" in feosd
    assert "feos-guest (>= 20261202022218)" in feosd
    assert pkgs["feos-guest"].depends == ["feos-guest-c50ac632ed49 (= 20261202022218)"]
    assert pkgs["feos-firecracker"].depends == ["feos-firecracker-v1.12.1 (= 1.12.1)"]
    assert pkgs["feos-python"].depends[:2] == ["python3 (>= 3.13)", "python3 (<< 3.14)"]
    assert set(pkgs["feosd"].conffiles) == {"/etc/default/feosd", "/etc/apt/apt.conf.d/50feosd"}
    text = plan.control(pkgs["feosd"], 12)
    assert text.startswith("Package: feosd\nVersion: 0.1.0+deb13\n")
    assert "\nDepends: feos-python (= 0.1.0+deb13), diskd (= 0.1.0+deb13), " in text


def test_delegate_subgroup_only_where_systemd_has_it() -> None:
    unit = (Path(__file__).resolve().parents[2] / "packaging/deb/files/feosd.service").read_text()
    assert "DelegateSubgroup=feosd\n" in plan.unit_text(unit, TRIXIE)
    assert "DelegateSubgroup" not in plan.unit_text(unit, BOOKWORM)
    assert "Delegate=yes\n" in plan.unit_text(unit, BOOKWORM)


def test_wheel_platforms_stop_at_the_distributions_glibc() -> None:
    tags = plan.platforms(36)
    assert "manylinux_2_36_x86_64" in tags and "manylinux_2_37_x86_64" not in tags
    assert "manylinux2014_x86_64" in tags
