"""A container's command looked up in its root before the create is answered (feos.guest)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.guest import _oci
from feos.guest._containers import _check_command, _executable_in

CONFIG = {"name": "web", "image": "registry.test/app:1"}


def _root(tmp_path: Path) -> Path:
    """A root laid out as busybox's image is: applets as symlinks, some relative, some not."""
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin" / "busybox").write_bytes(b"\x7fELF")
    os.chmod(root / "bin" / "busybox", 0o755)
    os.symlink("busybox", root / "bin" / "sh")
    os.symlink("/bin/busybox", root / "usr" / "bin" / "env")
    os.symlink("../../../../bin/busybox", root / "usr" / "bin" / "up")  # clamped at the root
    os.symlink("/usr/bin/true", root / "bin" / "outside")  # the image has none: the host does
    os.symlink("loop", root / "bin" / "loop")
    (root / "bin" / "data").write_text("not a program")
    (root / "app").mkdir()
    return root


def test_command_paths_follow_execvp() -> None:
    env = ["PATH=/usr/bin::rel", "A=1"]
    assert _oci.command_paths("sh", env, "/app") == ["/usr/bin/sh", "/app/./sh", "/app/rel/sh"]
    assert _oci.command_paths("./run", env, "/app") == ["/app/./run"]
    assert _oci.command_paths("/bin/sh", env, "/app") == ["/bin/sh"]
    assert _oci.command_paths("sh", [], "/")[0] == "/usr/local/sbin/sh"


@given(st.text(st.sampled_from("ab/.:"), max_size=12), st.text(st.sampled_from("ab/."), max_size=8))
def test_command_paths_are_absolute(path: str, arg0: str) -> None:
    for p in _oci.command_paths(arg0 or "x", [f"PATH={path}"], "/w"):
        assert p.startswith("/")


def test_executables_are_found_through_their_links(tmp_path: Path) -> None:
    root = str(_root(tmp_path))
    for found in ("/bin/busybox", "/bin/sh", "/usr/bin/env", "/usr/bin/up", "/bin/../bin/sh"):
        assert _executable_in(root, found), found
    for missing in ("/bin/none", "/bin/data", "/bin/loop", "/bin/outside", "/app", "/bin/sh/x"):
        assert not _executable_in(root, missing), missing


def test_a_missing_command_fails_the_create_with_its_name(tmp_path: Path) -> None:
    root = str(_root(tmp_path))
    env = _oci.merge_env([], [])
    _check_command(root, "sh", env, "/", [], CONFIG)
    _check_command(root, "/bin/sh", env, "/", [], CONFIG)
    with pytest.raises(FeosError) as e:
        _check_command(root, "sleepy", env, "/", [], CONFIG)
    assert e.value.code == Code.INVALID_ARGUMENT
    assert "'sleepy' is not an executable file in its PATH in image registry.test/app:1" in str(
        e.value
    )
    with pytest.raises(FeosError, match="'./run' is not an executable file in image"):
        _check_command(root, "./run", env, "/app", [], CONFIG)


def test_a_command_on_a_volume_is_left_to_the_start(tmp_path: Path) -> None:
    root = str(_root(tmp_path))
    _check_command(root, "/store/bin/tool", [], "/", ["/store"], CONFIG)
    _check_command(root, "tool", ["PATH=/store/bin"], "/", ["/store/"], CONFIG)
    with pytest.raises(FeosError):
        _check_command(root, "/storex/tool", [], "/", ["/store"], CONFIG)
