"""The image store's layers as overlayfs lowers against the flat unpack of the same layers.

A container's rootfs is an overlayfs of its image's layers, each unpacked once into a directory
of its own with its whiteouts kept as overlayfs marks them (feos.guest._unpack, overlay=True).
Stacks of random layers (files, directories, whiteouts, opaque directories, over and under each
other) mounted so must show the tree that unpacking the same layers one over another into one
directory gives (the unpack every container had before, itself tested against tarfile in
tests/unit/test_guest_tar.py). Whiteouts name what a layer below has, as image builders write
them. Root: mknod of the whiteouts, trusted xattrs, mount.
"""

from __future__ import annotations

import ctypes
import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from feos.guest import _unpack

segment = st.sampled_from(["a", "b", "c"])
paths = st.lists(segment, min_size=1, max_size=3).map("/".join)
kinds = st.sampled_from(["file", "dir", "whiteout", "opaque"])
layer = st.lists(st.tuples(paths, kinds, st.binary(max_size=20)), max_size=8,
                 unique_by=lambda e: e[0])  # fmt: skip
stacks = st.lists(layer, min_size=1, max_size=3)


def _consistent(entries: list[tuple[str, str, bytes]]) -> bool:
    """No entry of a layer under one of its own files or whiteouts (a path through a file fails
    both ways, differently; a layer does not hold that)."""
    leaves = [p for p, k, _ in entries if k in ("file", "whiteout")]
    return not any(q.startswith(p + "/") for p in leaves for q, _, _ in entries)


def _archive(entries: list[tuple[str, str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        named: set[str] = set()  # a layer names each parent before what is in it, as builders do
        for path, kind, data in entries:
            head, base = os.path.split(path)
            parts = head.split("/") if head else []
            for depth in range(1, len(parts) + 1):
                parent = "/".join(parts[:depth])
                if parent not in named:
                    named.add(parent)
                    tar.addfile(_info(parent, tarfile.DIRTYPE, 0))
            if kind == "whiteout":
                name, size = os.path.join(head, ".wh." + base), 0
            elif kind == "opaque":
                tar.addfile(_info(path, tarfile.DIRTYPE, 0))
                name, size = os.path.join(path, ".wh..wh..opq"), 0
            elif kind == "dir":
                tar.addfile(_info(path, tarfile.DIRTYPE, 0))
                continue
            else:
                name, size = path, len(data)
            tar.addfile(_info(name, tarfile.REGTYPE, size), io.BytesIO(data if size else b""))
    return out.getvalue()


def _info(name: str, kind: bytes, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime, info.uid, info.gid = kind, size, 0o644, 7, 0, 0
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    return info


def _tree(root: Path) -> dict[str, Any]:
    """What a container sees: names, kinds and file contents (directories' modes aside: an
    implied parent is made 0755 by either unpack, a real layer names its parents)."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else ("file", p.read_bytes(), p.lstat().st_mode & 0o7777)
    return out


def _mount(target: Path, lowers: list[Path], upper: Path, work: Path) -> None:
    options = (
        f"lowerdir={':'.join(str(p) for p in reversed(lowers))},upperdir={upper},workdir={work}"
    )
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"overlay", str(target).encode(), b"overlay", 0, options.encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount overlay")


@given(stacks)
@settings(max_examples=100, deadline=None)
def test_an_overlay_of_the_layers_is_their_flat_unpack(stack: list[Any]) -> None:
    stack = [entries for entries in stack if _consistent(entries)]
    if not stack:
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        flat, merged = base / "flat", base / "merged"
        lowers = []
        for i, entries in enumerate(stack):
            # a whiteout names what a layer below has (as an image's builder writes them):
            # one of nothing shows in overlayfs as the mark it is, in a directory of its own
            entries = [e for e in entries if e[1] != "whiteout" or os.path.lexists(flat / e[0])]
            blob = base / f"layer{i}"
            blob.write_bytes(_archive(entries))
            _unpack.apply_layer(str(blob), "", str(flat))
            lowers.append(base / f"lower{i}")
            _unpack.apply_layer(str(blob), "", str(lowers[-1]), overlay=True)
        flat.mkdir(exist_ok=True)
        for d in (merged, base / "upper", base / "work"):
            d.mkdir()
        _mount(merged, lowers, base / "upper", base / "work")
        try:
            assert _tree(merged) == _tree(flat), stack
        finally:
            ctypes.CDLL(None).umount2(str(merged).encode(), 2)


def test_whiteouts_are_kept_as_overlayfs_marks_them(tmp_path: Path) -> None:
    """A whiteout is a character device 0:0 in the name's place; an opaque directory carries
    trusted.overlay.opaque; what the layer itself puts at a whited-out name stays."""
    blob = tmp_path / "layer"
    blob.write_bytes(_archive([("gone", "whiteout", b""), ("dir", "opaque", b""),
                               ("dir/kept", "file", b"mine"), ("both", "file", b"x"),
                               ("both", "whiteout", b"")]))  # fmt: skip
    dest = tmp_path / "lower"
    _unpack.apply_layer(str(blob), "", str(dest), overlay=True)
    st_ = (dest / "gone").lstat()
    assert (os.major(st_.st_rdev), os.minor(st_.st_rdev)) == (0, 0)
    assert (st_.st_mode & 0o170000) == 0o020000  # a character device
    assert os.getxattr(dest / "dir", "trusted.overlay.opaque") == b"y"
    assert (dest / "dir" / "kept").read_bytes() == b"mine"
    assert (dest / "both").read_bytes() == b"x"
