"""packaging/guest/build.py's prune of old guest versions, on real directories in tmp_path.

The three signs of a version in use are made for real: a hard link from a microVM's directory,
a file this test holds open (as a running QEMU would), a symlink from a state dir's vms/*/*/.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

_BUILD = Path(__file__).resolve().parents[2] / "packaging/guest/build.py"


def _load() -> ModuleType:
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("feos_guest_build", _BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = before  # build.py puts its folder first, for its _plan
    return module


build = _load()


def _version(versions: Path, name: str, hours_ago: float) -> Path:
    d = versions / name
    d.mkdir(parents=True)
    for f in (*build.VERSION_FILES, "data.img.zst"):
        (d / f).write_bytes(name.encode())
    built = datetime.datetime.fromtimestamp(time.time() - hours_ago * 3600, datetime.UTC)
    manifest = {"version": name, "built": built.isoformat(timespec="seconds")}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_prune_removes_the_old_unused_and_keeps_the_rest(tmp_path: Path) -> None:
    versions = tmp_path / "guest"
    state = tmp_path / "state"
    hours = {"old1": 100, "old2": 99, "hard": 98, "opened": 97, "linked": 96, "mid": 50,
             "young": 10, "new1": 2, "new2": 1, "new3": 0.5}  # fmt: skip
    for name, h in hours.items():
        _version(versions, name, h)
    (versions / ".half-made.tmp-1").mkdir()  # an install under way: not a version
    (versions / "no-manifest").mkdir()
    vm_hard = state / "vms/qemu/vm-a"
    vm_hard.mkdir(parents=True)
    os.link(versions / "hard/root.erofs", vm_hard / "root.erofs")
    vm_sym = state / "vms/firecracker/vm-b"
    vm_sym.mkdir(parents=True)
    (vm_sym / "vmlinux").symlink_to(versions / "linked/vmlinux")
    held = (versions / "opened/root.erofs").open("rb")
    try:
        # kept: new1-3 (the newest three), young (under a day), hard, opened, linked (in use)
        assert build.prune(versions, 24.0, [state]) == ["old1", "old2", "mid"]
        assert build.prune(versions, 0.0, [state]) == ["young"]  # when told to keep none
    finally:
        held.close()
    left = sorted(p.name for p in versions.iterdir())
    assert left == [".half-made.tmp-1", "hard", "linked", "new1", "new2", "new3", "no-manifest",
                    "opened"]  # fmt: skip
    assert (vm_hard / "root.erofs").read_bytes() == b"hard"


def test_in_use_is_empty_for_versions_nothing_links(tmp_path: Path) -> None:
    versions = tmp_path / "guest"
    for name in ("a", "b"):
        _version(versions, name, 30)
    assert build.versions_in_use(versions, ["a", "b"], [tmp_path / "no-state"]) == set()
    assert sorted(build.installed(versions)) == ["a", "b"]
    assert build.installed(tmp_path / "missing") == {}
