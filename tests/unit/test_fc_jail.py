"""The jail's pure parts: which Firecracker runs, the microVM's user, jail.json, the argv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feos.errors import Code, FeosError
from feos.vmm import _jail
from feos.vmm._jail import Jail, JailRecord, Link


def _install(root: Path, version: str, *, jailer: bool = True) -> None:
    d = root / version
    d.mkdir(parents=True)
    for name in ("firecracker", "jailer") if jailer else ("firecracker",):
        (d / name).write_text("#!/bin/sh\n")
        (d / name).chmod(0o755)


def test_newest_version_with_both_binaries(tmp_path: Path) -> None:
    _install(tmp_path, "v1.9.0")
    _install(tmp_path, "v1.12.1")
    _install(tmp_path, "v1.17.0", jailer=False)  # half installed: not a candidate
    _install(tmp_path, "v1.10.2")
    (tmp_path / "notes").mkdir()
    assert [i.version for i in _jail.installed(tmp_path)] == ["v1.9.0", "v1.10.2", "v1.12.1"]
    chosen = _jail.choose(tmp_path)
    assert chosen == _jail.FcInstall("v1.12.1", tmp_path / "v1.12.1" / "firecracker",
                                     tmp_path / "v1.12.1" / "jailer")


def test_environment_overrides_the_directory(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "v1.12.1")
    monkeypatch.setenv(_jail.FIRECRACKER_DIR_ENV, str(tmp_path))
    assert _jail.choose().version == "v1.12.1"


def test_restore_needs_its_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "v1.12.1")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert _jail.find("v1.12.1", tmp_path).version == "v1.12.1"
    with pytest.raises(FeosError) as e:
        _jail.find("v1.10.0", tmp_path)
    assert e.value.code == Code.FAILED_PRECONDITION


def test_nothing_installed_nor_in_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FeosError, match="no Firecracker installed") as e:
        _jail.choose(tmp_path)
    assert e.value.code == Code.FAILED_PRECONDITION


def test_path_fallback_reads_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "firecracker").write_text("#!/bin/sh\necho 'Firecracker v1.13.0'\n")
    (bin_dir / "jailer").write_text("#!/bin/sh\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    got = _jail.choose(tmp_path / "none")
    assert (got.version, got.firecracker) == ("v1.13.0", bin_dir / "firecracker")


def test_users_are_the_lowest_free(tmp_path: Path) -> None:
    assert _jail.lowest_free(set()) == _jail.UID_BASE
    assert _jail.lowest_free({_jail.UID_BASE, _jail.UID_BASE + 2}) == _jail.UID_BASE + 1
    with pytest.raises(FeosError) as e:
        _jail.lowest_free(set(range(_jail.UID_BASE, _jail.UID_BASE + _jail.UID_COUNT)))
    assert e.value.code == Code.RESOURCE_EXHAUSTED


def test_make_gives_each_jail_its_user_and_keeps_it(tmp_path: Path) -> None:
    a, b = Jail(tmp_path, "aaaaaaaaaaa"), Jail(tmp_path, "bbbbbbbbbbb")
    ra, rb = _jail.make(a), _jail.make(b)
    assert (ra.uid, rb.uid) == (_jail.UID_BASE, _jail.UID_BASE + 1)
    assert _jail.make(a).uid == ra.uid
    assert a.root == tmp_path / "vms" / "firecracker" / "aaaaaaaaaaa" / "root"
    assert json.loads(a.record_path.read_text())["uid"] == ra.uid


def test_record_round_trip(tmp_path: Path) -> None:
    record = JailRecord(id="x", uid=900007, version="v1.12.1", firecracker="/fc", jailer="/j",
                        links=[Link("data", "/d", "hardlink", (0, 0)),
                               Link("vmlinux", "/k", "bind")],
                        taps=["pod-x"], taps_made=["pod-x"], netns="ns", cgroups=["/cg/vms/x"])
    assert JailRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_ids_the_jailer_takes() -> None:
    Jail(Path("/s"), "a0b1c2d3e4f")
    Jail(Path("/s"), "22222222-3333-4444-5555-666666666666")
    for bad in ("", "a/b", "x" * 65, "a b"):
        with pytest.raises(FeosError):
            Jail(Path("/s"), bad)


def test_jailer_argv() -> None:
    jail = Jail(Path("/var/lib/feos"), "podid")
    record = JailRecord(id="podid", uid=900003, firecracker="/fc/firecracker", jailer="/fc/jailer")
    argv = _jail.jailer_argv(jail, record, cgroup_args=None, metadata=True)
    assert argv == [
        "/fc/jailer", "--id", "podid", "--exec-file", "/fc/firecracker", "--uid", "900003",
        "--gid", "900003", "--chroot-base-dir", "/var/lib/feos/vms", "--cgroup-version", "1",
        "--", "--api-sock", "fc.sock", "--log-path", "vmm.log", "--level", "Info",
        "--metadata", "metadata.json"]
    assert "--daemonize" not in argv
    with_cg = _jail.jailer_argv(jail, record, cgroup_args=["--cgroup-version", "2"],
                                metadata=False, netns="/run/netns/x")
    assert with_cg[11:15] == ["--netns", "/run/netns/x", "--cgroup-version", "2"]
    assert "--metadata" not in with_cg


def test_the_driver_implements_the_interface(tmp_path: Path) -> None:
    from feos.vmm._driver import Driver
    from feos.vmm._firecracker import FirecrackerDriver

    driver = FirecrackerDriver(tmp_path)
    assert isinstance(driver, Driver)
    assert driver.name == "firecracker"
    assert driver.directory("abc") == tmp_path / "vms" / "firecracker" / "abc" / "root"
