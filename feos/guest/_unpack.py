"""Unpacking OCI layers into a rootfs, whiteouts applied (blocking; imported when needed).

A layer's whiteouts (.wh.<name>: remove <name> of the layers below; .wh..wh..opq: empty the
directory of what the layers below put there) are applied before its files are extracted, so
that its own entries in such a directory stay. tarfile's "tar" filter keeps every path inside
the rootfs and drops setuid bits (docs/guest.md); owners are kept numerically.
"""

from __future__ import annotations

import os
import shutil
import tarfile

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def _inside(root: str, name: str) -> str | None:
    path = os.path.normpath(os.path.join(root, name.lstrip("/")))
    return path if path == root or path.startswith(root + os.sep) else None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _whiteouts(root: str, members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Applies the layer's whiteouts; returns the members left to extract."""
    keep = []
    for m in members:
        head, base = os.path.split(m.name)
        if base == OPAQUE:
            target = _inside(root, head)
            if target and os.path.isdir(target):
                for entry in os.listdir(target):
                    _remove(os.path.join(target, entry))
        elif base.startswith(WHITEOUT):
            target = _inside(root, os.path.join(head, base[len(WHITEOUT) :]))
            if target and target != root:
                _remove(target)
        else:
            keep.append(m)
    return keep


def apply_layer(blob: str, compression: str, dest: str) -> None:
    root = os.path.realpath(dest)
    os.makedirs(root, exist_ok=True)
    with tarfile.open(blob, "r:gz" if compression == "gz" else "r:") as tar:
        members = _whiteouts(root, tar.getmembers())
        for m in members:
            # A file over an earlier layer's directory, or the reverse, replaces it.
            target = _inside(root, m.name)
            if target and target != root and os.path.lexists(target):
                if not (m.isdir() and os.path.isdir(target) and not os.path.islink(target)):
                    _remove(target)
        tar.extractall(root, members=members, numeric_owner=True, filter="tar")
