"""A tar reader for OCI layers, in one pass over the stream: ustar, GNU long names and pax
headers; octal and base-256 numbers; checksums checked.

Why not tarfile: its import (with gzip's) costs each pod's first unpack about 0.1 s under TCG,
and a layer needs only what this reads. Members come in archive order with their data read
through `Member.copy_to`; nothing is written here (feos/guest/_unpack.py extracts).
"""

from __future__ import annotations

import zlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import BinaryIO

BLOCK = 512
CHUNK = 1 << 16
REGULAR, HARDLINK, SYMLINK, CHAR, BLOCKDEV, DIRECTORY, FIFO = "0", "1", "2", "3", "4", "5", "6"
# No data follows these, whatever their size field says; every other type's data does (tarfile's
# reading: a type it does not know is a regular file).
NO_DATA = (HARDLINK, SYMLINK, CHAR, BLOCKDEV, DIRECTORY, FIFO)
MAX_HEADER_DATA = 1 << 20  # a pax or GNU long-name record larger than this is refused


class TarError(ValueError):
    """A layer that is not a tar archive this reads: a bad checksum, a cut stream, a bad field.
    It is the only exception a malformed archive raises here (zlib.error aside, for gzip)."""


# What a member's numbers may be: an owner is a uid_t, a time one that utime takes (a time_t),
# a size is not negative. A number outside is refused, never handed on to the OS to overflow.
RANGES = {"uid": (0, 1 << 32), "gid": (0, 1 << 32), "size": (0, 1 << 63),
          "mtime": (-(1 << 63), 1 << 63), "mode": (0, 1 << 63)}  # fmt: skip


class _Stream:
    """The layer's bytes, gunzipped as they are read when it is gzip-compressed."""

    def __init__(self, f: BinaryIO, gzip: bool) -> None:
        self.f = f
        self.z = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        self.buf = bytearray()
        self.eof = False

    def _fill(self, n: int) -> None:
        while len(self.buf) < n and not self.eof:
            raw = self.f.read(CHUNK)
            if self.z is None:
                if not raw:
                    self.eof = True
                self.buf += raw
                continue
            if not raw:
                self.buf += self.z.flush()
                self.eof = True
                continue
            self.buf += self.z.decompress(raw)
            while self.z.eof and self.z.unused_data:  # a second gzip member follows
                rest = self.z.unused_data
                self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self.buf += self.z.decompress(rest)

    def read(self, n: int) -> bytes:
        self._fill(n)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def exact(self, n: int) -> bytes:
        out = self.read(n)
        if len(out) != n:
            raise TarError("the layer ends inside a member")
        return out


class Member:
    __slots__ = ("_left", "_pad", "_stream", "gid", "linkname", "mode", "mtime", "name", "size",
                 "type", "uid")  # fmt: skip

    def __init__(self, stream: _Stream, fields: dict[str, object]) -> None:
        self._stream = stream
        self.name = str(fields["name"])
        self.linkname = str(fields["linkname"])
        self.type = str(fields["type"])
        self.mode, self.uid, self.gid = int(fields["mode"]), int(fields["uid"]), int(fields["gid"])  # type: ignore[call-overload]
        self.size, self.mtime = int(fields["size"]), int(fields["mtime"])  # type: ignore[call-overload]
        self._left = 0 if self.type in NO_DATA else self.size  # as tarfile reads them
        self._pad = -self._left % BLOCK

    def copy_to(self, write: Callable[[bytes], object]) -> None:
        """The member's data, to write(chunk) (once; skipped if never called)."""
        while self._left:
            chunk = self._stream.exact(min(self._left, CHUNK))
            self._left -= len(chunk)
            write(chunk)

    def _finish(self) -> None:
        while self._left:  # what copy_to did not read
            self._left -= len(self._stream.exact(min(self._left, CHUNK)))
        if self._pad:
            self._stream.exact(self._pad)


def _number(field: bytes, what: str) -> int:
    if field and field[0] in (0x80, 0xFF):  # base-256 (GNU): 0x80 positive, 0xFF negative
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0x80 else value - (1 << (8 * (len(field) - 1)))
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarError(f"a header's {what} is not a number: {text[:20]!r}") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _header(block: bytes) -> dict[str, object]:
    stored = _number(block[148:156], "checksum")
    summed = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 32
    if stored not in (summed, signed):
        raise TarError("a header whose checksum does not match (not a tar layer, or damaged)")
    name = _text(block[0:100])
    if block[257:262] == b"ustar":
        prefix = _text(block[345:500])
        if prefix:
            name = f"{prefix}/{name}"
    return {"name": name, "mode": _number(block[100:108], "mode"),
            "uid": _number(block[108:116], "uid"), "gid": _number(block[116:124], "gid"),
            "size": _number(block[124:136], "size"), "mtime": _number(block[136:148], "mtime"),
            "type": chr(block[156]) if block[156] else "0",
            "linkname": _text(block[157:257])}  # fmt: skip


def _pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.find(b" ", at)
        if space < 0:
            break
        try:
            length = int(data[at:space])
        except ValueError:
            raise TarError("a pax header record without its length") from None
        record = data[space + 1 : at + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise TarError("a pax header record that does not parse")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return out


def _pax_fields(pax: dict[str, str], pending: dict[str, object]) -> None:
    """What a pax header sets of the next member (tarfile's parse: int, mtime a float)."""
    for key, field in (("path", "name"), ("linkpath", "linkname")):
        if key in pax:
            pending[field] = pax[key]
    for key in ("size", "uid", "gid", "mtime"):
        if key in pax:
            try:
                pending[key] = int(pax[key]) if key != "mtime" else float(pax[key])
            except ValueError:
                raise TarError(f"a pax header's {key} is not a number: {pax[key][:20]!r}") from None


def _checked(fields: dict[str, object]) -> dict[str, object]:
    """The member's fields, each in the range the OS takes (an mtime made whole)."""
    for key, (low, high) in RANGES.items():
        value = fields[key]
        if not low <= value < high:  # type: ignore[operator]  # (false for nan)
            raise TarError(f"a member's {key} is out of range: {str(value)[:24]}")
        fields[key] = int(value)  # type: ignore[call-overload]
    for key in ("name", "linkname"):
        if "\0" in str(fields[key]):
            raise TarError(f"a member's {key} holds a NUL byte")
    return fields


def members(f: BinaryIO, gzip: bool) -> Iterator[Member]:
    """The layer's members in order; each one's data is skipped when the next is asked for."""
    stream = _Stream(f, gzip)
    pending: dict[str, object] = {}
    while True:
        block = stream.read(BLOCK)
        if not block or block == bytes(BLOCK):
            return  # the end (two zero blocks), or a stream that stops at a member's end
        if len(block) != BLOCK:
            raise TarError("the layer ends inside a header")
        fields = _header(block)
        kind = fields["type"]
        if kind in ("x", "g", "L", "K"):
            size = int(fields["size"])  # type: ignore[call-overload]
            if not 0 <= size <= MAX_HEADER_DATA:
                raise TarError(f"an extended header of {size} bytes")
            data = stream.exact(size)
            if size % BLOCK:
                stream.exact(-size % BLOCK)
            if kind == "x":
                _pax_fields(_pax(data), pending)
            elif kind in ("L", "K"):
                pending["name" if kind == "L" else "linkname"] = _text(data)
            continue  # a global pax header ("g") changes nothing a layer needs
        fields.update(pending)
        pending = {}
        member = Member(stream, _checked(fields))
        yield member
        member._finish()
