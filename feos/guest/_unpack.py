"""Unpacking OCI layers into a rootfs, whiteouts applied (blocking; imported when needed).

A layer's whiteouts (.wh.<name>: remove <name> of the layers below; .wh..wh..opq: empty the
directory of what the layers below put there) are applied before its files are extracted, so
that its own entries in such a directory stay. Every member must land inside the rootfs, also
through the symlinks earlier members made, and a hard link must point inside it; device nodes
are skipped. Modes and numeric owners are kept. (Debian 12's Python 3.11.2 predates tarfile's
extraction filters, so the checks are here.)
"""

from __future__ import annotations

import os
import shutil
import tarfile

from feos.errors import Code, FeosError

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


def _refuse(blob: str, m: tarfile.TarInfo, why: str) -> FeosError:
    layer = os.path.basename(blob)[:12]
    return FeosError(Code.FAILED_PRECONDITION, f"layer {layer}: {m.name!r} {why}")


def _check(root: str, blob: str, m: tarfile.TarInfo) -> str:
    """The member's path in the rootfs, its directory resolved through the symlinks there."""
    target = _inside(root, m.name)
    if target is None:
        raise _refuse(blob, m, "is outside the rootfs")
    parent = os.path.realpath(os.path.dirname(target))
    if parent != root and not parent.startswith(root + os.sep):
        raise _refuse(blob, m, "goes through a link out of the rootfs")
    if m.islnk() and _inside(root, m.linkname) is None:
        raise _refuse(blob, m, "is a hard link out of the rootfs")
    return os.path.join(parent, os.path.basename(target))


def apply_layer(blob: str, compression: str, dest: str) -> None:
    root = os.path.realpath(dest)
    os.makedirs(root, exist_ok=True)
    with tarfile.open(blob, "r:gz" if compression == "gz" else "r:") as tar:
        for m in _whiteouts(root, tar.getmembers()):
            if m.ischr() or m.isblk() or (m.name.strip("/") in ("", ".")):
                continue
            target = _check(root, blob, m)
            # A file over an earlier layer's directory, or the reverse, replaces it.
            if target != root and os.path.lexists(target):
                if not (m.isdir() and os.path.isdir(target) and not os.path.islink(target)):
                    _remove(target)
            tar.extract(m, root, numeric_owner=True)
