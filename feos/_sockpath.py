"""Unix socket paths that fit the kernel's sun_path, however deep the directory they are in.

A Unix socket's address holds at most 108 bytes, its NUL included. feosd's sockets live in
directories an operator (or a test's tmp_path) chooses: <run-dir>/api.sock, and in every
microVM's directory below <state-dir> guest.sock, qmp.sock, fc.sock and v.sock. A path past the
limit is refused by bind and connect alike (ENAMETOOLONG, or Python's "AF_UNIX path too
long"), so the socket is reached instead through a descriptor of its directory:
/proc/self/fd/N/NAME, where N is an O_PATH descriptor of the directory, held open while the
call resolves the path. Only the socket's own name must be short, and those are ours.

The VMMs bind their sockets by relative names in their own working directory (QEMU's -chdir,
Firecracker's jail), so only feosd's side of each socket goes through `reachable`.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
from collections.abc import Iterator
from pathlib import Path

SUN_PATH_MAX = 107  # bytes of a path, without the NUL that ends it


@contextlib.contextmanager
def reachable(path: str | os.PathLike[str]) -> Iterator[str]:
    """A path to bind or connect to that reaches `path` and fits sun_path, for the block."""
    text = os.fspath(path)
    if len(os.fsencode(text)) <= SUN_PATH_MAX:
        yield text
        return
    directory, name = os.path.split(text)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at path (made anew): the group feos's, mode 0660, if that group
    exists, else root's alone (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with reachable(path) as short:
        sock.bind(short)
    try:
        gid = grp.getgrnam("feos").gr_gid
    except KeyError:
        os.chmod(path, 0o600)
    else:
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
    sock.listen(128)
    return sock
