"""Unpacking OCI layers into a rootfs, whiteouts applied (blocking; imported when needed).

A layer's whiteouts (.wh.<name>: remove <name> of the layers below; .wh..wh..opq: empty the
directory of what the layers below put there) spare what the layer itself puts there, wherever
they come in its archive. Unpacked into a directory of its own (overlay=True), as a lower layer of
an overlayfs, a layer keeps them as overlayfs marks them: a character device 0:0 in the name's
place, the xattr trusted.overlay.opaque "y" on the directory. Every member must land inside the
rootfs, also through the symlinks earlier members made, and a hard link must point inside it;
device nodes are skipped. Modes, numeric owners (as root) and times are kept. The archive is read
in one pass by _tar (not tarfile: its import and gzip's cost each pod's first unpack about 0.1 s
under TCG).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import zlib

from feos.errors import Code, FeosError

from . import _tar

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
# What the OS refuses of a member because of the node, not of the layer: raised as they are.
NOT_THE_LAYER = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EROFS)


def _inside(root: str, name: str) -> str | None:
    path = os.path.normpath(os.path.join(root, name.lstrip("/")))
    return path if path == root or path.startswith(root + os.sep) else None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


class _Layer:
    """One layer's extraction into root: what it made so far, and its parents' real paths."""

    def __init__(self, root: str, blob: str, overlay: bool = False) -> None:
        self.root, self.blob, self.overlay = root, blob, overlay
        self.marks: list[str] = []  # overlay: the whiteouts' devices made
        self.opaque: list[str] = []  # overlay: the directories marked opaque
        self.made: set[str] = set()  # its paths and parents: its whiteouts spare them
        self.real: dict[str, str] = {}  # a parent directory's realpath, until a member changes it
        self.root_owner = os.geteuid() == 0

    def refuse(self, m: _tar.Member, why: str) -> FeosError:
        layer = os.path.basename(self.blob)[:12]
        return FeosError(Code.FAILED_PRECONDITION, f"layer {layer}: {m.name!r} {why}")

    def changed(self, path: str) -> None:
        """What is at path is new: cached real paths through it, or to it, are stale."""

        def through(p: str) -> bool:
            return p == path or p.startswith(path + os.sep)

        for key in [k for k, real in self.real.items() if through(k) or through(real)]:
            del self.real[key]

    def resolve(self, m: _tar.Member, name: str, outside: str, through: str) -> str:
        """name's path in the rootfs, its directory resolved through the symlinks there; the
        member is refused, saying outside or through, when either leaves the rootfs."""
        path = _inside(self.root, name)
        if path is None:
            raise self.refuse(m, outside)
        lexical = os.path.dirname(path)
        parent = self.real.get(lexical)
        if parent is None:
            parent = self.real[lexical] = os.path.realpath(lexical)
        if parent != self.root and not parent.startswith(self.root + os.sep):
            raise self.refuse(m, through)
        return os.path.join(parent, os.path.basename(path))

    def place(self, m: _tar.Member) -> str:
        """The member's path in the rootfs (and its hard link's source, checked as well)."""
        if m.type == _tar.HARDLINK:
            self.resolve(m, m.linkname, "is a hard link out of the rootfs",
                         "is a hard link through a link out of the rootfs")  # fmt: skip
        return self.resolve(m, m.name, "is outside the rootfs",
                            "goes through a link out of the rootfs")  # fmt: skip

    def mark(self, target: str) -> None:
        while target not in self.made and target != self.root:
            self.made.add(target)
            target = os.path.dirname(target)

    def whiteout(self, m: _tar.Member, head: str, base: str) -> None:
        if self.overlay:
            self.overlay_whiteout(m, head, base)
            return
        if base == OPAQUE:
            target = _inside(self.root, head)
            if target and os.path.isdir(target) and not os.path.islink(target):
                self.clear(target)
            return
        target = _inside(self.root, os.path.join(head, base[len(WHITEOUT) :]))
        if target and target != self.root and target not in self.made:
            _remove(target)
            self.changed(target)

    def overlay_whiteout(self, m: _tar.Member, head: str, base: str) -> None:
        """The whiteout as overlayfs keeps it, in this layer's own directory (what the layer
        itself makes at the name, before or after, wins: the spec's rule)."""
        if base == OPAQUE:
            directory = self.resolve(m, os.path.join(head, "x"), "is outside the rootfs",
                                     "goes through a link out of the rootfs")  # fmt: skip
            directory = os.path.dirname(directory)
            os.makedirs(directory, exist_ok=True)
            os.setxattr(directory, "trusted.overlay.opaque", b"y")
            self.opaque.append(directory)
            return
        target = self.resolve(m, os.path.join(head, base[len(WHITEOUT):]),
                              "is outside the rootfs", "goes through a link out of the rootfs")
        if target == self.root or target in self.made or os.path.lexists(target):
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
        self.marks.append(target)

    def finish(self) -> None:
        """A whiteout under a directory the layer made opaque hides nothing more, and overlayfs
        would list it there (nothing below merges with it): removed."""
        for mark in self.marks:
            if any(mark.startswith(d + os.sep) for d in self.opaque) and _is_mark(mark):
                os.unlink(mark)

    def clear(self, directory: str) -> None:
        """Empties directory of what the layers below put there (this layer's own stay)."""
        for entry in os.listdir(directory):
            path = os.path.join(directory, entry)
            if path not in self.made:
                _remove(path)
                self.changed(path)
            elif os.path.isdir(path) and not os.path.islink(path):
                self.clear(path)

    def extract(self, m: _tar.Member) -> None:
        if m.type in (_tar.CHAR, _tar.BLOCKDEV) or m.name.strip("/") in ("", "."):
            return
        head, base = os.path.split(m.name.rstrip("/"))
        if base == OPAQUE or base.startswith(WHITEOUT):
            self.whiteout(m, head, base)
            return
        target = self.place(m)
        is_dir = m.type == _tar.DIRECTORY
        # A file over an earlier layer's directory, or the reverse, replaces it.
        if target != self.root and os.path.lexists(target):
            if not (is_dir and os.path.isdir(target) and not os.path.islink(target)):
                _remove(target)
                self.changed(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if is_dir:
            os.makedirs(target, exist_ok=True)
        elif m.type == _tar.SYMLINK:
            os.symlink(m.linkname, target)
            self.changed(target)
        elif m.type == _tar.HARDLINK:
            source = self.resolve(m, m.linkname, "", "")  # checked by place()
            os.link(source, target, follow_symlinks=False)
        elif m.type == _tar.FIFO:
            os.mkfifo(target)
        else:  # regular, contiguous, or a type this does not know: its data, as tarfile does
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb", closefd=True) as f:
                m.copy_to(f.write)
        self.attributes(m, target)
        self.mark(target)

    def attributes(self, m: _tar.Member, target: str) -> None:
        link = m.type == _tar.SYMLINK
        if self.root_owner:
            os.chown(target, m.uid, m.gid, follow_symlinks=False)
        if not link:
            os.chmod(target, m.mode & 0o7777)
            os.utime(target, (m.mtime, m.mtime))


def apply_layer(blob: str, compression: str, dest: str, *, overlay: bool = False) -> None:
    """Extracts the layer into dest (overlay: dest is the layer's own, its whiteouts kept as
    overlayfs marks). A layer that is not a tar archive, is cut short, holds a
    bad field, or a member the filesystem cannot make (a name too long, a path through a file)
    fails with FAILED_PRECONDITION naming the layer (and the member); a full disk is raised as
    the OSError it is."""
    root = os.path.realpath(dest)
    os.makedirs(root, exist_ok=True)
    layer = _Layer(root, blob, overlay)
    try:
        with open(blob, "rb") as f:
            for m in _tar.members(f, compression == "gz"):
                _extract(layer, m)
        if overlay:
            layer.finish()
    except (_tar.TarError, zlib.error) as e:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"layer {os.path.basename(blob)[:12]}: {e}") from None  # fmt: skip


def _is_mark(path: str) -> bool:
    """Whether path is a whiteout's device still (a later member may have replaced it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _extract(layer: _Layer, m: _tar.Member) -> None:
    try:
        layer.extract(m)
    except OSError as e:
        if e.errno in NOT_THE_LAYER:
            raise
        raise layer.refuse(m, f"cannot be made: {e.strerror or e}") from None
