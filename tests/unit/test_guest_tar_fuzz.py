"""The guest's layer reader (feos.guest._tar) and extraction (_unpack) on malformed archives.

A malformed layer fails the create with FAILED_PRECONDITION naming the layer (docs/guest.md):
_tar raises TarError and nothing else, _unpack turns it into that FeosError. Here: pax numbers
that are no numbers or do not fit (mtime=nan, uid=abc, mtime=1e400, a negative size), GNU
base-256 numbers out of range, NUL bytes in names, members the filesystem cannot make; and valid
archives (ustar, GNU, pax, plain and gzip) built by tarfile, then damaged: bytes flipped, set,
inserted and deleted inside a block, numeric fields rewritten, pax records given any value, with
every header's checksum made right again so that the damage reaches the fields behind it.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.guest import _tar, _unpack


def _archive(pax: dict[str, str] | None = None, name: str = "a", fmt: int = tarfile.PAX_FORMAT,
             **fields: Any) -> bytes:  # fmt: skip
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        for key, value in fields.items():
            setattr(info, key, value)
        info.pax_headers = dict(pax or {})
        tar.addfile(info, io.BytesIO(b"abc"))
    return out.getvalue()


def _read_all(raw: bytes, gz: bool = False) -> None:
    for m in _tar.members(io.BytesIO(raw), gz):
        m.copy_to(lambda chunk: None)


def _apply(raw: bytes, tmp: Path, gz: bool = False) -> None:
    blob = tmp / "0123456789abcdef"
    blob.write_bytes(raw)
    _unpack.apply_layer(str(blob), "gz" if gz else "", str(tmp / "rootfs"))


BAD_PAX = [({"mtime": "nan"}, "mtime"), ({"mtime": "1e400"}, "mtime"), ({"mtime": "inf"}, "mtime"),
           ({"uid": "abc"}, "uid"), ({"gid": "1.5"}, "gid"), ({"size": "-1"}, "size"),
           ({"uid": "-1"}, "uid"), ({"uid": str(1 << 32)}, "uid"), ({"size": "x"}, "size"),
           ({"mtime": "1e30"}, "mtime"), ({"path": "a\0b"}, "name"),
           ({"linkpath": "x\0"}, "linkname")]  # fmt: skip


@pytest.mark.parametrize(("pax", "field"), BAD_PAX)
def test_a_pax_header_out_of_range_is_a_tar_error(pax: dict[str, str], field: str,
                                                  tmp_path: Path) -> None:  # fmt: skip
    raw = _archive(pax)
    with pytest.raises(_tar.TarError, match=field):
        _read_all(raw)
    with pytest.raises(FeosError, match="layer 0123456789ab: ") as e:
        _apply(raw, tmp_path)
    assert e.value.code == Code.FAILED_PRECONDITION


def _set_number(raw: bytes, offset: int, width: int, field: bytes) -> bytes:
    """The first header's numeric field at offset replaced (a base-256 one), checksum fixed."""
    block = bytearray(raw[:512])
    block[offset : offset + width] = field.rjust(width, b"\0")[:width]
    _fix_checksum(block)
    return bytes(block) + raw[512:]


def _fix_checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


@pytest.mark.parametrize(("offset", "width", "field"), [
    (108, 8, b"\xff" * 8),  # uid -1
    (136, 12, b"\x80" + b"\xff" * 11),  # mtime 2**88 - 1
    (124, 12, b"\xff" * 12),  # size -1
    (116, 8, b"\x80\x00\x00\x01\x00\x00\x00\x00"),  # gid 2**32
])  # fmt: skip
def test_a_base_256_number_out_of_range_is_a_tar_error(offset: int, width: int, field: bytes,
                                                       tmp_path: Path) -> None:  # fmt: skip
    raw = _set_number(_archive(fmt=tarfile.GNU_FORMAT), offset, width, field)
    with pytest.raises(_tar.TarError, match="out of range"):
        _read_all(raw)
    with pytest.raises(FeosError) as e:
        _apply(raw, tmp_path)
    assert e.value.code == Code.FAILED_PRECONDITION


def test_base_256_numbers_read_as_tarfile_reads_them() -> None:
    raw = _archive(fmt=tarfile.GNU_FORMAT, uid=8**8 + 5, mtime=-(2**40))  # too big for octal
    (m,) = _tar.members(io.BytesIO(raw), False)
    assert (m.uid, m.mtime) == (8**8 + 5, -(2**40))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        assert (tar.getmembers()[0].uid, tar.getmembers()[0].mtime) == (m.uid, m.mtime)


def test_a_member_the_filesystem_cannot_make_names_it(tmp_path: Path) -> None:
    raw = _archive(name="x" * 300)  # a file name of 300 bytes: ENAMETOOLONG
    with pytest.raises(FeosError, match="'x{300}' cannot be made: File name too long") as e:
        _apply(raw, tmp_path)
    assert e.value.code == Code.FAILED_PRECONDITION


# Damaged valid archives ----------------------------------------------------------------------

names = st.text("abcxyz-_.0123456789/", min_size=1, max_size=120).filter(
    lambda s: s.strip("/") not in ("", ".", "..") and ".wh." not in s
)
entries = st.lists(st.tuples(names, st.sampled_from(["file", "dir", "symlink", "link", "fifo"]),
                             st.binary(max_size=1500), st.integers(0, 2**34)),
                   min_size=1, max_size=5)  # fmt: skip
formats = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
PAX_KEYS = ["mtime", "uid", "gid", "size", "path", "linkpath", "atime", "comment"]
pax_values = st.one_of(st.sampled_from(["nan", "-1", "1e400", "abc", "", "1.5", "0x10", "1_0",
                                        " 7", "+3", "-0", "9" * 30]),
                       st.text(max_size=12))  # fmt: skip
paxes = st.dictionaries(st.sampled_from(PAX_KEYS), pax_values, max_size=3)


def _build(items: list[tuple[str, str, bytes, int]], fmt: int, pax: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for i, (name, kind, data, mtime) in enumerate(items):
            if fmt == tarfile.USTAR_FORMAT and (len(name) > 99 or mtime >= 8**11):
                continue  # what ustar cannot hold
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.mode = mtime, 1000 + i, 100, 0o644
            if fmt == tarfile.PAX_FORMAT and i == 0:
                info.pax_headers = dict(pax)
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "link": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[kind]  # fmt: skip
            info.linkname = items[0][0] if kind != "fifo" else ""
            tar.addfile(info)
    return out.getvalue()


def _header_blocks(raw: bytes) -> list[int]:
    """The indexes of the blocks that are headers, in a valid archive."""
    out, at = [], 0
    while at + 512 <= len(raw) and raw[at : at + 512] != bytes(512):
        info = tarfile.TarInfo.frombuf(raw[at : at + 512], "utf-8", "surrogateescape")
        out.append(at // 512)
        has_data = info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, b"x", b"g", b"L", b"K")
        at += 512 + (-(-info.size // 512) * 512 if has_data else 0)
    return out


NUMBER_FIELDS = [(100, 8), (108, 8), (116, 8), (124, 12), (136, 12)]  # mode uid gid size mtime
numbers = st.one_of(st.binary(min_size=1, max_size=12),
                    st.integers(-(2**95), 2**95).map(lambda n: (n % 2**88).to_bytes(11, "big")),
                    st.text("01234567 \0", max_size=12).map(str.encode))  # fmt: skip
damages = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "number"]),
                             st.integers(0, 2**20), st.integers(0, 511), st.integers(0, 255),
                             numbers),
                   min_size=1, max_size=4)  # fmt: skip


def _damage(raw: bytes, ops: list[tuple[Any, ...]]) -> bytes:
    heads = _header_blocks(raw) or [0]
    buf = bytearray(raw)
    blocks = len(buf) // 512
    for kind, which, at, value, number in ops:
        block = heads[which % len(heads)] if kind == "number" or which % 2 else which % blocks
        start = block * 512
        if kind == "flip":
            buf[start + at] ^= 1 << (value % 8)
        elif kind == "set":
            buf[start + at] = value
        elif kind == "insert":  # inside the block: its last byte goes
            buf[start : start + 512] = (buf[start : start + at] + bytes([value]) +
                                        buf[start + at : start + 511])  # fmt: skip
        elif kind == "delete":  # inside the block: a NUL comes at its end
            buf[start : start + 512] = buf[start : start + at] + buf[start + at + 1 : start + 512]
            buf[start + 511 : start + 511] = b"\0"
        else:
            offset, width = NUMBER_FIELDS[value % len(NUMBER_FIELDS)]
            if value & 0x80:  # a base-256 number
                number = bytes([0x80 if value & 0x40 else 0xFF]) + number
            buf[start + offset : start + offset + width] = number.rjust(width, b"\0")[-width:]
    for block in heads:  # the damage reaches the fields: every header sums right
        head = buf[block * 512 : block * 512 + 512]
        _fix_checksum(head)
        buf[block * 512 : block * 512 + 512] = head
    return bytes(buf)


@given(entries, formats, paxes, damages, st.booleans())
@settings(max_examples=500, deadline=None)
def test_damaged_archives_end_in_a_tar_error(items: Any, fmt: int, pax: Any, ops: Any,
                                             gz: bool) -> None:  # fmt: skip
    raw = _damage(_build(items, fmt, pax), ops)
    try:
        _read_all(gzip.compress(raw) if gz else raw, gz)
    except _tar.TarError:
        pass


@given(entries, formats, paxes, damages, st.booleans())
@settings(max_examples=150, deadline=None)
def test_damaged_archives_fail_the_unpack_as_documented(items: Any, fmt: int, pax: Any,
                                                        ops: Any, gz: bool) -> None:  # fmt: skip
    raw = _damage(_build(items, fmt, pax), ops)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _apply(gzip.compress(raw) if gz else raw, Path(tmp), gz)
        except FeosError as e:
            assert e.code == Code.FAILED_PRECONDITION, e
            assert e.message.startswith("layer 0123456789ab: ")
        _no_escape(Path(tmp))


def _no_escape(tmp: Path) -> None:
    """Nothing was made beside the blob and the rootfs."""
    assert sorted(os.listdir(tmp)) in (["0123456789abcdef"], ["0123456789abcdef", "rootfs"])


@given(st.binary(min_size=1, max_size=64), st.integers(0, 10**6))
@settings(max_examples=100, deadline=None)
def test_damaged_gzip_ends_in_a_tar_or_zlib_error(garbage: bytes, at: int) -> None:
    raw = bytearray(gzip.compress(_build([("a", "file", b"x" * 3000, 1)], tarfile.PAX_FORMAT, {})))
    pos = at % len(raw)
    raw[pos : pos + len(garbage)] = garbage
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _apply(bytes(raw), Path(tmp), gz=True)
        except FeosError as e:
            assert e.code == Code.FAILED_PRECONDITION, e
