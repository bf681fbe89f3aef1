"""feos.guest._tar against Python's tarfile, and feos.guest._unpack's extraction with it.

Archives written by tarfile in its three formats (ustar, GNU with long names, pax), plain and
gzip-compressed, read back member by member as tarfile reads them; random and cut bytes end in
TarError; a layer extracted by _unpack gives the tree tarfile's extractall gives.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import FeosError
from feos.guest import _tar, _unpack

segment = st.text("abcxyz-_.0123456789", min_size=1, max_size=40).filter(
    lambda s: s not in (".", "..") and not s.startswith(".wh.")
)
paths = st.lists(segment, min_size=1, max_size=4).map("/".join)  # up to 163 chars: long names
entries = st.lists(
    st.tuples(paths, st.sampled_from(["file", "dir", "symlink"]), st.binary(max_size=3000),
              st.sampled_from([0o644, 0o755, 0o600, 0o4755]), st.integers(0, 2**33)),
    max_size=12, unique_by=lambda e: e[0],
)  # fmt: skip
formats = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])


def _archive(items: list[tuple[str, str, bytes, int, int]], fmt: int, gz: bool) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for path, kind, data, mode, mtime in items:
            if fmt == tarfile.USTAR_FORMAT and (len(path) > 99 or mtime >= 8**11):
                continue  # what ustar cannot hold
            info = tarfile.TarInfo(path)
            info.mode, info.mtime, info.uid, info.gid = mode, mtime, 1000, 100
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "target/" + path[:60]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = out.getvalue()
    return gzip.compress(raw) if gz else raw


def _ours(raw: bytes, gz: bool) -> list[tuple[Any, ...]]:
    got = []
    for m in _tar.members(io.BytesIO(raw), gz):
        data = bytearray()
        m.copy_to(data.extend)
        got.append((m.name.rstrip("/"), m.type, m.linkname, m.mode, m.uid, m.gid, m.mtime,
                    bytes(data)))  # fmt: skip
    return got


def _theirs(raw: bytes, gz: bool) -> list[tuple[Any, ...]]:
    got = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz" if gz else "r:") as tar:
        for m in tar.getmembers():
            has_data = m.isreg() or m.type not in tarfile.SUPPORTED_TYPES  # tarfile's own rule
            f = tar.extractfile(m) if has_data else None
            data = f.read() if f else b""
            got.append((m.name.rstrip("/"), m.type.decode(), m.linkname, m.mode, m.uid, m.gid,
                        int(m.mtime), data))  # fmt: skip
    return got


@given(entries, formats, st.booleans())
@settings(max_examples=150, deadline=None)
def test_members_read_as_tarfile_reads_them(items: Any, fmt: int, gz: bool) -> None:
    raw = _archive(items, fmt, gz)
    assert _ours(raw, gz) == _theirs(raw, gz)


def test_members_skipped_unread_still_advance() -> None:
    raw = _archive([("a", "file", b"x" * 5000, 0o644, 1), ("b", "file", b"y", 0o644, 2)],
                   tarfile.GNU_FORMAT, False)  # fmt: skip
    assert [m.name for m in _tar.members(io.BytesIO(raw), False)] == ["a", "b"]


@given(st.binary(max_size=2048))
@settings(max_examples=200, deadline=None)
def test_random_bytes_end_in_a_tar_error_or_nothing(data: bytes) -> None:
    try:
        _read_all(data)
    except _tar.TarError:
        pass


def _read_all(raw: bytes) -> None:
    for m in _tar.members(io.BytesIO(raw), False):
        m.copy_to(lambda chunk: None)


def test_a_cut_layer_is_a_tar_error() -> None:
    raw = _archive([("a", "file", b"x" * 5000, 0o644, 1)], tarfile.PAX_FORMAT, False)
    with pytest.raises(_tar.TarError, match="ends inside"):
        _read_all(raw[:2048])


def test_a_type_it_does_not_know_is_a_file_with_its_data(tmp_path: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, data in (("odd", b"Z", b"its data"), ("dir", tarfile.DIRTYPE, b""),
                                 ("after", tarfile.REGTYPE, b"next")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.size, info.mode = kind, len(data), 0o644
            tar.addfile(info, io.BytesIO(data) if data else None)
    raw = out.getvalue()
    assert _ours(raw, False) == _theirs(raw, False)
    blob = tmp_path / "layer"
    blob.write_bytes(raw)
    _unpack.apply_layer(str(blob), "", str(tmp_path / "rootfs"))
    assert (tmp_path / "rootfs/odd").read_bytes() == b"its data"
    assert (tmp_path / "rootfs/after").read_bytes() == b"next"


def test_hard_links_and_fifos_are_made(tmp_path: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = 4, 0o755
        tar.addfile(info, io.BytesIO(b"\x7fELF"))
        for name, kind, link in (("bin/sh", tarfile.LNKTYPE, "bin/busybox"),
                                 ("run/pipe", tarfile.FIFOTYPE, "")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, link, 0o644
            tar.addfile(info)
    blob = tmp_path / "layer"
    blob.write_bytes(out.getvalue())
    root = tmp_path / "rootfs"
    _unpack.apply_layer(str(blob), "", str(root))
    assert (root / "bin/sh").stat().st_ino == (root / "bin/busybox").stat().st_ino
    assert (root / "bin/sh").read_bytes() == b"\x7fELF"
    assert stat.S_ISFIFO((root / "run/pipe").lstat().st_mode)


def _tree(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel, st_ = str(p.relative_to(root)), p.lstat()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir", st_.st_mode & 0o7777)
        else:
            out[rel] = ("file", st_.st_mode & 0o7777, int(st_.st_mtime), p.read_bytes())
    return out


@given(entries, formats, st.booleans())
@settings(max_examples=40, deadline=None)
def test_a_layer_extracts_as_tarfile_extracts_it(items: Any, fmt: int, gz: bool) -> None:
    import tempfile

    files = [e[0] for e in items if e[1] != "dir"]
    every = [e[0].rstrip("/") for e in items]
    if any(b.startswith(a + "/") for a in files for b in every):
        return  # a file and a path (a file's or a directory's) under it: both fail, differently
    raw = _archive([(p, k, d, m | 0o200, t) for p, k, d, m, t in items], fmt, gz)
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp, "layer")
        blob.write_bytes(raw)
        ours, theirs = Path(tmp, "ours"), Path(tmp, "theirs")
        _unpack.apply_layer(str(blob), "gz" if gz else "", str(ours))
        with tarfile.open(blob, "r:gz" if gz else "r:") as tar:
            tar.extractall(theirs, numeric_owner=True)
        theirs.mkdir(exist_ok=True)
        assert _tree(ours) == _tree(theirs)


def test_a_layer_that_is_not_tar_is_refused_by_name(tmp_path: Path) -> None:
    blob = tmp_path / "0123456789abcdef"
    blob.write_bytes(gzip.compress(b"not a tar archive at all" * 40))
    with pytest.raises(FeosError, match="layer 0123456789ab: a header.s checksum"):
        _unpack.apply_layer(str(blob), "gz", str(tmp_path / "rootfs"))
    blob.write_bytes(b"\x1f\x8b" + b"not gzip")
    with pytest.raises(FeosError, match="layer 0123456789ab: "):
        _unpack.apply_layer(str(blob), "gz", str(tmp_path / "rootfs"))


def test_a_hard_link_cannot_reach_out_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not the image's")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, link in (("out", tarfile.SYMTYPE, str(outside)),
                                 ("stolen", tarfile.LNKTYPE, "out/secret")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            tar.addfile(info)
    blob = tmp_path / "0123456789abcdef"
    blob.write_bytes(out.getvalue())
    with pytest.raises(FeosError, match="'stolen' is a hard link through a link out of the rootfs"):
        _unpack.apply_layer(str(blob), "", str(tmp_path / "rootfs"))
    assert not (tmp_path / "rootfs/stolen").exists()
    assert (outside / "secret").stat().st_nlink == 1
