"""feos.guest._initramfs keeps what another filesystem holds: the root mounted inside the tree.

A tmpfs of the test's own (removed after) mounted where the guest's root is mounted under the
initramfs (/root), with a file in it.
"""

from __future__ import annotations

import os

from conftest import run
from feos.guest import _initramfs


def test_a_mount_point_is_kept_with_all_it_holds(tmp_path: str) -> None:
    root = f"{tmp_path}/initramfs"
    os.makedirs(f"{root}/root")
    os.makedirs(f"{root}/bin")
    with open(f"{root}/bin/busybox", "wb") as f:
        f.write(b"x" * 8192)
    run("mount", "-t", "tmpfs", "-o", "size=1m", "feostest-initramfs", f"{root}/root")
    try:
        with open(f"{root}/root/kept", "w") as f:
            f.write("the root's")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            removed, kept = _initramfs.remove_under(fd)
        finally:
            os.close(fd)
        assert sorted(os.listdir(root)) == ["root"]
        assert (removed, kept) == (2, 1)
        with open(f"{root}/root/kept") as f:
            assert f.read() == "the root's"
    finally:
        run("umount", f"{root}/root")
