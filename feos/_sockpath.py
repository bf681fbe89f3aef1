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
import os
from collections.abc import Iterator

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
