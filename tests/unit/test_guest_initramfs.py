"""feos.guest._initramfs: the initramfs's files removed through /init's descriptor, after the start.

On real directories in tmp_path (the kernel tier adds a mount point inside: tests/kernel/
test_guest_initramfs_mount.py); the guest's own removal shows in the integration tier's console.
"""

from __future__ import annotations

import os
import time

from feos.guest import _initramfs


def _tree(root: str, outside: str) -> None:
    os.makedirs(f"{root}/lib/modules/6.1/kernel/fs", exist_ok=True)
    os.makedirs(f"{root}/dev", exist_ok=True)
    os.makedirs(f"{outside}/keep", exist_ok=True)
    for path in ("init", "lib/modules/6.1/kernel/fs/ext4.ko", "lib/modules/6.1/modules.dep"):
        with open(f"{root}/{path}", "wb") as f:
            f.write(b"x" * 4096)
    with open(f"{outside}/keep/file", "w") as f:
        f.write("kept")
    os.symlink("busybox", f"{root}/sh")  # a dangling link, as the applets' are
    os.symlink(outside, f"{root}/escape")  # a link to a directory: removed, never followed


def test_everything_under_the_descriptor_goes_and_nothing_else(tmp_path: str) -> None:
    root, outside = f"{tmp_path}/initramfs", f"{tmp_path}/outside"
    _tree(root, outside)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed, kept = _initramfs.remove_under(fd)
    finally:
        os.close(fd)
    assert os.listdir(root) == []
    assert (removed, kept) == (11, 0)  # 3 files, 2 links, 6 directories
    with open(f"{outside}/keep/file") as f:
        assert f.read() == "kept"


def test_take_reads_the_environment_once_and_hides_the_descriptor(tmp_path: str) -> None:
    fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    os.set_inheritable(fd, True)
    env = {_initramfs.ENV: str(fd), "PATH": "/bin"}
    try:
        assert _initramfs.take(env) == fd
        assert env == {"PATH": "/bin"}  # no child of the agent sees it
        assert not os.get_inheritable(fd)
        assert _initramfs.take(env) is None
    finally:
        os.close(fd)


def test_take_refuses_what_is_not_a_directory(tmp_path: str) -> None:
    path = f"{tmp_path}/f"
    with open(path, "w"):
        pass
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _initramfs.take({_initramfs.ENV: str(fd)}) is None
        assert _initramfs.take({_initramfs.ENV: "not-a-number"}) is None
        assert _initramfs.take({_initramfs.ENV: "999999"}) is None  # closed
    finally:
        os.close(fd)


def test_release_removes_on_a_thread_closes_and_says_so(tmp_path: str) -> None:
    root = f"{tmp_path}/initramfs"
    _tree(root, f"{tmp_path}/outside")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    said: list[str] = []
    _initramfs.release(fd, said.append).join(10)
    assert os.listdir(root) == []
    assert said and said[0].startswith("the initramfs's files removed: 11, kept 0 (")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.fstat(fd)
        except OSError:
            break  # closed
        time.sleep(0.01)
    else:
        raise AssertionError("release did not close the descriptor")
