"""Cap'n Proto messages in plain Python, for the guest: readers and builders over the layouts of
feos/guest/_layout.py (schema/guest.capnp and rpc.capnp), with pycapnp's attribute style.

Why not pycapnp in the guest: its import (a 19 MB extension, run cold) and the schema's parse
cost the agent's start about 0.25 s under TCG, and the agent reads and writes a few small
messages. The node keeps pycapnp; tests/unit/test_guest_wire.py holds the two to the same bytes.

Reading follows the encoding spec: struct, list, far (single and double landing pads) and
capability pointers, every list element size, composite lists, unions, groups, scalar defaults
(the wire holds a field XOR its default), fields past a struct's end read as their defaults (an
older peer). A bad pointer raises WireError. Building writes one segment; setting a union's
member sets its discriminant. Lists of structs are always composite, as C++ writes them.
"""

from __future__ import annotations

import struct

from . import _layout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class WireError(ValueError):
    """A message that does not decode: a pointer out of its segment, a wrong kind, too deep."""


_WORD = struct.Struct("<Q")
_UNPACK_WORD = _WORD.unpack_from
_HEADER = struct.Struct("<II")
SCALARS = {"i8": struct.Struct("<b"), "u8": struct.Struct("<B"), "i16": struct.Struct("<h"),
           "u16": struct.Struct("<H"), "i32": struct.Struct("<i"), "u32": struct.Struct("<I"),
           "i64": struct.Struct("<q"), "u64": struct.Struct("<Q"), "f32": struct.Struct("<f"),
           "f64": struct.Struct("<d"), "enum": struct.Struct("<H")}  # fmt: skip
_SIZE_CODE = {1: 2, 2: 3, 4: 4, 8: 5}  # element bytes -> list element size code
_ELEMENT_BITS = (0, 1, 8, 16, 32, 64, 64, 0)  # by element size code (7: composite)
_DATA_BITS = (0, 1, 8, 16, 32, 64, 0, 0)  # an element's data and pointers, by size code
_POINTERS = (0, 0, 0, 0, 0, 0, 1, 0)
MAX_SEGMENTS = 512
MAX_DEPTH = 64


INT, POINTER = 0, 1  # Field.fast: what a read can do at once (else StructReader._get)


class Field:
    __slots__ = ("byte", "default", "disc", "end", "extra", "fast", "kind", "name", "offset",
                 "unpack")  # fmt: skip

    def __init__(self, spec: tuple[Any, ...]) -> None:
        self.name, self.disc, self.kind, self.offset, self.extra, self.default = spec
        if self.default is None:
            self.default = 0
        self.fast = -1
        st = SCALARS.get(self.kind)
        if st is not None and self.kind not in ("enum", "f32", "f64"):
            self.fast, self.unpack = INT, st.unpack_from
            self.byte = self.offset * st.size
            self.end = self.byte + st.size
        elif self.kind in ("struct", "text", "data", "list", "cap"):
            self.fast = POINTER


class Layout:
    """A struct's or a group's layout, by node id (one object each, made on first use)."""

    __slots__ = ("by_disc", "data_words", "disc", "fields", "id", "name", "ptrs")

    def __init__(self, node_id: int) -> None:
        self.id = node_id
        self.name, self.data_words, self.ptrs, self.disc, specs = _layout.STRUCTS[node_id]
        self.fields = {spec[0]: Field(spec) for spec in specs}
        self.by_disc = {f.disc: f.name for f in self.fields.values() if f.disc >= 0}

    @classmethod
    def of(cls, node_id: int) -> Layout:
        made = _LAYOUTS.get(node_id)
        if made is None:
            made = _LAYOUTS[node_id] = cls(node_id)
        return made

    @classmethod
    def named(cls, name: str) -> Layout:
        return cls.of(_layout.NAMES[name])

    def field(self, name: str) -> Field:
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(f"{self.name} has no field {name!r}") from None


_LAYOUTS: dict[int, Layout] = {}


def _signed30(w: int) -> int:
    off = (w >> 2) & 0x3FFFFFFF
    return off - (1 << 30) if off & (1 << 29) else off


# Reading ---------------------------------------------------------------------------------------


class Message:
    """A received message: its segments (bytes-like) and the capabilities its cap table named."""

    __slots__ = ("_budget", "caps", "segments")

    def __init__(self, segments: list[Any], caps: list[Any] | None = None) -> None:
        self.segments = segments
        self.caps = caps if caps is not None else []
        self._budget = 8 * sum(len(s) for s in segments) + 64  # words read, against loops

    def word(self, seg: int, at: int) -> int:
        segments = self.segments
        s = segments[seg] if 0 <= seg < len(segments) else self._segment(seg)
        if at < 0 or (at << 3) + 8 > len(s):
            raise WireError(f"a pointer out of segment {seg} (word {at} of {len(s) // 8})")
        return _UNPACK_WORD(s, at << 3)[0]  # type: ignore[no-any-return]

    def _segment(self, seg: int) -> Any:
        if not 0 <= seg < len(self.segments):
            raise WireError(f"a far pointer to segment {seg} of {len(self.segments)}")
        return self.segments[seg]

    def check(self, seg: int, start: int, words: int) -> Any:
        """The segment, once words from start are known to lie in it (an object of no words
        lies anywhere: nothing of it is read, and C++ takes it so)."""
        s = self._segment(seg)
        if words and (start < 0 or start + words > len(s) // 8):
            raise WireError(f"an object out of segment {seg} (words {start}+{words})")
        self.charge(words + 1)
        return s

    def charge(self, words: int) -> None:
        """Counts words read against the budget (a list of zero-sized elements costs a word
        each, as in Cap'n Proto's C++: else it could claim 2**29 elements in no words)."""
        self._budget -= words
        if self._budget < 0:
            raise WireError("the message reads more than it holds (an amplification)")

    def resolve(self, seg: int, at: int) -> tuple[int, int, int]:
        """The pointer at word at: (segment, content's first word, tag word), far ones followed."""
        w = self.word(seg, at)
        if w & 3 != 2:
            return seg, at + 1 + _signed30(w), w
        double = (w >> 2) & 1
        pad, seg = (w >> 3) & 0x1FFFFFFF, w >> 32
        landing = self.word(seg, pad)
        if not double:
            if landing & 3 == 2:
                raise WireError("a single far pointer lands on another far pointer")
            return seg, pad + 1 + _signed30(landing), landing
        if landing & 3 != 2:  # its own double bit is not looked at, as C++ does not
            raise WireError("a double far pointer's pad is not a far pointer")
        tag = self.word(seg, pad + 1)
        return landing >> 32, (landing >> 3) & 0x1FFFFFFF, tag

    @classmethod
    def from_frame(cls, frame: bytes | memoryview) -> Message:
        """A message from its stream framing (the whole frame, as frame_size measured it)."""
        view = memoryview(frame)
        size = frame_size(view)
        if not size or size > len(view):
            raise WireError(f"a frame of {len(view)} bytes, short of its segments")
        count = int.from_bytes(view[0:4], "little") + 1
        sizes = [int.from_bytes(view[4 + 4 * i : 8 + 4 * i], "little") for i in range(count)]
        at = (4 + 4 * count + 7) // 8 * 8
        segments = []
        for size in sizes:
            segments.append(view[at : at + 8 * size])
            at += 8 * size
        return cls(segments)

    def root(self, layout: Layout) -> StructReader:
        return struct_at(self, 0, 0, layout, 0)


def frame_size(buf: bytes | bytearray | memoryview) -> int:
    """Bytes of the first framed message in buf, 0 while its header is incomplete."""
    if len(buf) < 4:
        return 0
    count = int.from_bytes(buf[0:4], "little") + 1
    if count > MAX_SEGMENTS:
        raise WireError(f"a message of {count} segments (at most {MAX_SEGMENTS})")
    header = (4 + 4 * count + 7) // 8 * 8
    if len(buf) < 4 + 4 * count:
        return 0
    words = sum(int.from_bytes(buf[4 + 4 * i : 8 + 4 * i], "little") for i in range(count))
    return header + 8 * words


def struct_at(msg: Message, seg: int, at: int, layout: Layout, depth: int) -> StructReader:
    """The struct the pointer at (seg, at) points to; a null pointer reads as all defaults."""
    if depth > MAX_DEPTH:
        raise WireError(f"pointers nested deeper than {MAX_DEPTH}")
    tag = msg.word(seg, at)
    if tag == 0:
        return StructReader(msg, 0, 0, 0, 0, 0, layout, depth)
    if tag & 3 == 0:  # a struct pointer in the same segment: the common case
        start = at + 1 + _signed30(tag)
    else:
        seg, start, tag = msg.resolve(seg, at)
    if tag & 3 != 0:
        raise WireError(f"{layout.name}: expected a struct pointer, found kind {tag & 3}")
    data, ptrs = (tag >> 32) & 0xFFFF, tag >> 48
    msg.check(seg, start, data + ptrs)
    return StructReader(msg, seg, start * 8, data * 8, start + data, ptrs, layout, depth)


class StructReader:
    """A struct on the wire: its data section (_size bytes from byte _data of its segment: a
    word multiple, or 1, 2 or 4 bytes for an element of a list of narrow structs) and its
    pointers (_nptrs words from word _ptr). A field past either end reads as its default."""

    __slots__ = ("_data", "_depth", "_layout", "_msg", "_nptrs", "_ptr", "_seg", "_size")

    def __init__(self, msg: Message, seg: int, data: int, size: int, ptr: int, nptrs: int,
                 layout: Layout, depth: int) -> None:  # fmt: skip
        self._msg, self._seg, self._data, self._size = msg, seg, data, size
        self._ptr, self._nptrs, self._layout, self._depth = ptr, nptrs, layout, depth

    def __getattr__(self, name: str) -> Any:
        f = self._layout.fields.get(name)
        if f is None:
            if name.startswith("_"):
                raise AttributeError(name)
            f = self._layout.field(name)
        if f.disc >= 0 and self._discriminant() != f.disc:
            return _absent(f)
        fast = f.fast
        if fast == INT:
            if f.end > self._size:
                return f.default
            value = f.unpack(self._msg.segments[self._seg], self._data + f.byte)[0]
            return value ^ f.default if f.default else value
        if fast == POINTER:
            if f.offset >= self._nptrs:
                return _absent(f)
            return read_pointer(self._msg, self._seg, self._ptr + f.offset, (f.kind, f.extra),
                                self._depth + 1)  # fmt: skip
        return self._get(f)

    def _discriminant(self) -> int:
        return self._scalar(SCALARS["u16"], self._layout.disc * 2, 0)

    def which(self) -> str:
        d = self._discriminant()
        try:
            return self._layout.by_disc[d]
        except KeyError:
            raise WireError(f"{self._layout.name}: a union member {d} this schema lacks") from None

    def _scalar(self, st: struct.Struct, byte: int, default: int) -> Any:
        if byte + st.size > self._size:
            return default
        seg = self._msg.segments[self._seg]
        return st.unpack_from(seg, self._data + byte)[0] ^ default if default else \
            st.unpack_from(seg, self._data + byte)[0]  # fmt: skip

    def _pointer_word(self, index: int) -> int:
        return self._msg.word(self._seg, self._ptr + index) if index < self._nptrs else 0

    def _get(self, f: Field) -> Any:
        """The kinds __getattr__ does not read at once: enums, floats, bools, voids, groups and
        AnyPointers."""
        kind = f.kind
        if kind == "enum":
            return _enum_name(f.extra, self._scalar(SCALARS["enum"], f.offset * 2, f.default))
        if kind in ("f32", "f64"):
            st = SCALARS[kind]
            return self._scalar(st, f.offset * st.size, 0)
        if kind == "bool":
            byte = f.offset >> 3
            if byte >= self._size:
                return bool(f.default)
            bit = (self._msg.segments[self._seg][self._data + byte] >> (f.offset & 7)) & 1
            return bool(bit ^ f.default)
        if kind == "void":
            return None
        if kind == "group":
            return StructReader(self._msg, self._seg, self._data, self._size, self._ptr,
                                self._nptrs, Layout.of(f.extra), self._depth)  # fmt: skip
        if f.offset >= self._nptrs:
            return _absent(f)
        return read_pointer(self._msg, self._seg, self._ptr + f.offset, (kind, f.extra),
                            self._depth + 1)  # fmt: skip

    def _has(self, name: str) -> bool:
        f = self._layout.field(name)
        if f.disc >= 0 and self._discriminant() != f.disc:
            return False
        if f.kind in SCALARS or f.kind in ("bool", "void", "group"):
            return True
        return self._pointer_word(f.offset) != 0

    def pointer(self, name: str) -> tuple[Message, int, int]:
        """Where a pointer field is (an AnyPointer's content, read as some struct or cap)."""
        f = self._layout.field(name)
        if f.offset >= self._nptrs:
            return _NULL_MESSAGE, 0, 0
        return self._msg, self._seg, self._ptr + f.offset

    def to_dict(self) -> dict[str, Any]:
        """The fields (a union's active member only; a struct only when set, as pycapnp's
        to_dict: a recursive type's defaults would never end), nested as dicts and lists: for
        tests."""
        out: dict[str, Any] = {}
        for name, f in self._layout.fields.items():
            if f.disc >= 0 and self._discriminant() != f.disc:
                continue
            if f.kind == "struct" and not self._pointer_word(f.offset):
                continue
            value = getattr(self, name)
            out[name] = _plain(value)
        return out

    def __repr__(self) -> str:
        return f"<{self._layout.name} {self.to_dict()}>"


_NULL_MESSAGE = Message([bytes(8)])


def _plain(value: Any) -> Any:
    if isinstance(value, StructReader):
        return value.to_dict()
    if isinstance(value, ListReader):
        return [_plain(v) for v in value]
    return value


def _enum_name(enum_id: int, value: int) -> Any:
    names = _layout.ENUMS[enum_id][1]
    return names[value] if value < len(names) else value


def _absent(f: Field) -> Any:
    """What a field not on the wire reads as (its default; empty text, data and lists)."""
    kind = f.kind
    if kind == "enum":
        return _enum_name(f.extra, f.default)
    if kind in SCALARS:
        return f.default
    if kind == "bool":
        return bool(f.default)
    if kind == "text":
        return ""
    if kind == "data":
        return b""
    if kind == "list":
        return ListReader(_NULL_MESSAGE, 0, 0, 0, 0, f.extra, 0, 0, 0)
    if kind == "struct":
        return StructReader(_NULL_MESSAGE, 0, 0, 0, 0, 0, Layout.of(f.extra), 0)
    return None  # void, a null capability or AnyPointer


def read_pointer(msg: Message, seg: int, at: int, spec: tuple[Any, Any], depth: int) -> Any:
    """The value of kind spec = (kind, extra) the pointer at (seg, at) holds."""
    kind, extra = spec
    if kind == "struct":
        return struct_at(msg, seg, at, Layout.of(extra), depth)
    w = msg.word(seg, at)
    if kind == "cap":
        if w == 0:
            return None
        if w & 0xFFFFFFFF != 3:
            raise WireError(f"expected a capability pointer, found {w:#x}")
        index = w >> 32
        if index >= len(msg.caps):
            raise WireError(f"capability {index} of a cap table of {len(msg.caps)}")
        return msg.caps[index]
    if kind == "any":
        return (msg, seg, at)
    if w == 0:
        return "" if kind == "text" else b"" if kind == "data" else \
            ListReader(_NULL_MESSAGE, 0, 0, 0, 0, extra, 0, 0, 0)  # fmt: skip
    if depth > MAX_DEPTH:
        raise WireError(f"pointers nested deeper than {MAX_DEPTH}")
    if w & 3 == 1:  # a list pointer in the same segment
        start, tag = at + 1 + _signed30(w), w
    else:
        seg, start, tag = msg.resolve(seg, at)
    if tag & 3 != 1:
        raise WireError(f"expected a list pointer for {kind}, found kind {tag & 3}")
    size, count = (tag >> 32) & 7, tag >> 35
    if kind in ("text", "data"):
        if size != 2:
            raise WireError(f"{kind} as a list of element size {size}, not bytes")
        s = msg.check(seg, start, (count + 7) // 8)
        raw = bytes(s[start * 8 : start * 8 + count])
        if kind == "data":
            return raw
        return _text(raw)
    if size == 7:
        s = msg.check(seg, start, 1 + count)
        tag2 = int(_WORD.unpack_from(s, start * 8)[0])
        # The tag is a struct pointer whose offset is the element count, 29 bits unsigned.
        n, data, ptrs = (tag2 >> 2) & 0x1FFFFFFF, (tag2 >> 32) & 0xFFFF, tag2 >> 48
        if tag2 & 3 != 0 or n * (data + ptrs) > count:
            raise WireError("a composite list whose tag does not fit its words")
        if not data + ptrs:
            msg.charge(n)
        _check_elements(extra, 7, data, ptrs)
        return ListReader(msg, seg, start + 1, 7, n, extra, data, ptrs, depth)
    msg.check(seg, start, (count * _ELEMENT_BITS[size] + 63) // 64)
    if not size:
        msg.charge(count)
    _check_elements(extra, size, 0, 0)
    return ListReader(msg, seg, start, size, count, extra, 0, 0, depth)


def _expected_size(elem: tuple[Any, Any]) -> int:
    """The element size code a list of elem is written with."""
    kind = elem[0]
    if kind == "struct":
        return 7
    if kind in ("text", "data", "list", "cap", "any"):
        return 6
    if kind in SCALARS:
        return _SIZE_CODE[SCALARS[kind].size]
    return 1 if kind == "bool" else 0


def _check_elements(elem: tuple[Any, Any], size: int, data: int, ptrs: int) -> None:
    """A list of element size `size` (data words and pointers of a composite's elements) read
    as a list of elem, as Cap'n Proto's C++ takes it: an element may be wider than the schema's
    (an upgrade; what is read is its first field), never narrower, and no bits are structs."""
    want = _expected_size(elem)
    if size == 7:
        bad = want == 1 or (2 <= want <= 5 and not data) or (want == 6 and not ptrs)
    else:
        bad = (size == 1 and want != 1) or _DATA_BITS[want] > _DATA_BITS[size] or \
            _POINTERS[want] > _POINTERS[size]  # fmt: skip
    if bad:
        raise WireError(f"a list of element size {size} read as a list of {elem[0]}")


def _text(raw: bytes) -> str:
    if not raw or raw[-1] != 0:
        raise WireError("text without its NUL")
    try:
        return raw[:-1].decode()
    except UnicodeDecodeError as e:
        raise WireError(f"text that is not UTF-8 ({e.reason})") from None


class _List:
    """What a list reader and a list builder share: a length, iteration, an index checked."""

    __slots__ = ()
    _n: int

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Any:
        return (self[i] for i in range(self._n))  # type: ignore[index]

    def _index(self, i: int) -> int:
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return i


class ListReader(_List):
    __slots__ = ("_data", "_depth", "_elem", "_msg", "_n", "_ptrs", "_seg", "_size", "_start")

    def __init__(self, msg: Message, seg: int, start: int, size: int, n: int,
                 elem: tuple[Any, Any], data: int, ptrs: int, depth: int) -> None:  # fmt: skip
        self._msg, self._seg, self._start, self._size, self._n = msg, seg, start, size, n
        self._elem, self._data, self._ptrs, self._depth = elem, data, ptrs, depth

    def __getitem__(self, i: int) -> Any:
        i = self._index(i)
        kind, extra = self._elem
        size = self._size
        if kind == "struct":
            return self._struct(i, Layout.of(extra))
        # read_pointer checked the element size fits kind (_check_elements): an element wider
        # than kind's (a struct list's, or wider numbers) is read as its first field.
        if kind in ("text", "data", "list", "cap", "any"):
            at = self._start + i
            if size == 7:  # a struct list read as pointers: each element's first pointer
                at = self._start + i * (self._data + self._ptrs) + self._data
            return read_pointer(self._msg, self._seg, at, self._elem, self._depth + 1)
        if kind == "void":
            return None
        seg = self._msg.segments[self._seg]
        if size == 7:
            byte, bit = (self._start + i * (self._data + self._ptrs)) * 8, 0
        else:
            bits = i * _DATA_BITS[size]
            byte, bit = self._start * 8 + (bits >> 3), bits & 7
        if kind == "bool":
            return bool((seg[byte] >> bit) & 1)
        value = SCALARS[kind].unpack_from(seg, byte)[0]
        return _enum_name(extra, value) if kind == "enum" else value

    def _struct(self, i: int, layout: Layout) -> StructReader:
        if self._size == 7:
            words = self._data + self._ptrs
            start = self._start + i * words
            data, ptrs = self._data, self._ptrs
            return StructReader(self._msg, self._seg, start * 8, data * 8, start + data, ptrs,
                                layout, self._depth + 1)  # fmt: skip
        bits = _ELEMENT_BITS[self._size]
        if self._size == 6:  # a list of pointers read as structs: the pointer is the struct's
            return StructReader(self._msg, self._seg, 0, 0, self._start + i, 1, layout,
                                self._depth + 1)  # fmt: skip
        if self._size in (0, 1) or bits == 0:
            return StructReader(self._msg, self._seg, 0, 0, 0, 0, layout, self._depth + 1)
        # Data-only elements of 1, 2, 4 or 8 bytes: the data section is the element, no wider.
        byte = self._start * 8 + i * bits // 8
        return StructReader(self._msg, self._seg, byte, bits // 8, 0, 0, layout, self._depth + 1)


# Building --------------------------------------------------------------------------------------


class Builder:
    """A message being built, in one segment; caps: what its capability pointers stand for."""

    __slots__ = ("buf", "caps")

    def __init__(self) -> None:
        self.buf = bytearray(8)  # the root pointer
        self.caps: list[Any] = []

    def alloc(self, words: int) -> int:
        at = len(self.buf) // 8
        self.buf += bytes(8 * words)
        return at

    def init_root(self, layout: Layout) -> StructBuilder:
        return self.init_struct(0, layout)

    def init_struct(self, ptr: int, layout: Layout) -> StructBuilder:
        start = self.alloc(layout.data_words + layout.ptrs)
        self.put_word(ptr, _struct_pointer(start - ptr - 1, layout.data_words, layout.ptrs))
        return StructBuilder(self, start * 8, layout.data_words, start + layout.data_words,
                             layout.ptrs, layout)  # fmt: skip

    def put_word(self, at: int, w: int) -> None:
        _WORD.pack_into(self.buf, at * 8, w)

    def put_cap(self, ptr: int, cap: Any) -> None:
        if cap is None:
            self.put_word(ptr, 0)
            return
        self.caps.append(cap)
        self.put_word(ptr, 3 | (len(self.caps) - 1) << 32)

    def put_bytes(self, ptr: int, raw: bytes, text: bool) -> None:
        n = len(raw) + (1 if text else 0)
        start = self.alloc((n + 7) // 8)
        self.buf[start * 8 : start * 8 + len(raw)] = raw
        self.put_word(ptr, _list_pointer(start - ptr - 1, 2, n))

    def init_list(self, ptr: int, elem: tuple[Any, Any], n: int) -> ListBuilder:
        kind, extra = elem
        if kind == "struct":
            layout = Layout.of(extra)
            per = layout.data_words + layout.ptrs
            tag = self.alloc(1 + n * per)
            self.put_word(ptr, _list_pointer(tag - ptr - 1, 7, n * per))
            self.put_word(tag, _struct_pointer(n, layout.data_words, layout.ptrs))
            return ListBuilder(self, tag + 1, n, elem, layout)
        if kind in ("text", "data", "list", "cap", "any"):
            size, words = 6, n
        elif kind == "bool":
            size, words = 1, (n + 63) // 64
        elif kind == "void":
            size, words = 0, 0
        else:
            nbytes = SCALARS[kind].size
            size, words = _SIZE_CODE[nbytes], (n * nbytes + 7) // 8
        start = self.alloc(words)
        self.put_word(ptr, _list_pointer(start - ptr - 1, size, n))
        return ListBuilder(self, start, n, elem, None)

    def frame(self) -> bytes:
        """The message with its stream framing: one segment."""
        return _HEADER.pack(0, len(self.buf) // 8) + bytes(self.buf)


def _struct_pointer(offset: int, data: int, ptrs: int) -> int:
    return ((offset & 0x3FFFFFFF) << 2) | data << 32 | ptrs << 48


def _list_pointer(offset: int, size: int, count: int) -> int:
    return 1 | ((offset & 0x3FFFFFFF) << 2) | size << 32 | count << 35


class StructBuilder:
    __slots__ = ("_b", "_data", "_layout", "_nptrs", "_ptr", "_words")

    def __init__(self, b: Builder, data: int, words: int, ptr: int, nptrs: int,
                 layout: Layout) -> None:  # fmt: skip
        object.__setattr__(self, "_b", b)
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_words", words)
        object.__setattr__(self, "_ptr", ptr)
        object.__setattr__(self, "_nptrs", nptrs)
        object.__setattr__(self, "_layout", layout)

    def _member(self, f: Field) -> None:
        if f.disc >= 0:
            SCALARS["u16"].pack_into(self._b.buf, self._data + self._layout.disc * 2, f.disc)

    def __setattr__(self, name: str, value: Any) -> None:
        f = self._layout.field(name)
        self._member(f)
        kind, buf = f.kind, self._b.buf
        st = SCALARS.get(kind)
        if st is not None:
            if kind == "enum":
                value = _enum_value(f.extra, value)
            if kind in ("f32", "f64"):
                st.pack_into(buf, self._data + f.offset * st.size, value)
            else:
                st.pack_into(buf, self._data + f.offset * st.size, int(value) ^ f.default)
        elif kind == "bool":
            byte, bit = self._data + (f.offset >> 3), 1 << (f.offset & 7)
            if bool(value) ^ bool(f.default):
                buf[byte] |= bit
            else:
                buf[byte] &= ~bit & 0xFF
        elif kind == "void":
            pass
        elif kind == "text":
            self._b.put_bytes(self._ptr + f.offset, str(value).encode(), text=True)
        elif kind == "data":
            self._b.put_bytes(self._ptr + f.offset, bytes(value), text=False)
        elif kind == "cap":
            self._b.put_cap(self._ptr + f.offset, value)
        elif kind == "list":
            items = list(value)
            out = self._b.init_list(self._ptr + f.offset, f.extra, len(items))
            for i, item in enumerate(items):
                out[i] = item
        else:
            raise TypeError(f"{self._layout.name}.{name}: set its {kind} with init()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        f = self._layout.field(name)
        if f.kind == "struct" and (f.disc < 0 or self._discriminant() == f.disc):
            at = self._ptr + f.offset
            w = int(_WORD.unpack_from(self._b.buf, at * 8)[0])
            if w:  # set already: the same struct, as pycapnp's builders give it
                start = at + 1 + _signed30(w)
                data, ptrs = (w >> 32) & 0xFFFF, w >> 48
                return StructBuilder(self._b, start * 8, data, start + data, ptrs,
                                     Layout.of(f.extra))  # fmt: skip
        if f.kind in ("struct", "group"):
            return self.init(name)
        raise AttributeError(f"{self._layout.name}.{name}: builders read back structs only")

    def _discriminant(self) -> int:
        return int(SCALARS["u16"].unpack_from(self._b.buf, self._data + self._layout.disc * 2)[0])

    def init(self, name: str, n: int | None = None) -> Any:
        f = self._layout.field(name)
        self._member(f)
        if f.kind == "group":
            return StructBuilder(self._b, self._data, self._words, self._ptr, self._nptrs,
                                 Layout.of(f.extra))  # fmt: skip
        if f.kind == "struct":
            return self._b.init_struct(self._ptr + f.offset, Layout.of(f.extra))
        if f.kind == "list":
            if n is None:
                raise TypeError(f"{self._layout.name}.{name}: init a list with its length")
            return self._b.init_list(self._ptr + f.offset, f.extra, n)
        if f.kind == "void":
            return None
        raise TypeError(f"{self._layout.name}.{name}: a {f.kind} is set, not initialised")

    def init_any(self, name: str, layout: Layout) -> StructBuilder:
        """An AnyPointer field made a struct of layout (a payload's content)."""
        return self._b.init_struct(self._ptr + self._layout.field(name).offset, layout)

    def set_any_cap(self, name: str, cap: Any) -> None:
        self._b.put_cap(self._ptr + self._layout.field(name).offset, cap)


def _enum_value(enum_id: int, value: Any) -> int:
    if isinstance(value, int):
        return value
    try:
        return _layout.ENUMS[enum_id][1].index(str(value))
    except ValueError:
        name, values = _layout.ENUMS[enum_id]
        raise ValueError(f"{name}: no enumerant {value!r} (one of {', '.join(values)})") from None


class ListBuilder(_List):
    __slots__ = ("_b", "_elem", "_layout", "_n", "_start")

    def __init__(self, b: Builder, start: int, n: int, elem: tuple[Any, Any],
                 layout: Layout | None) -> None:  # fmt: skip
        self._b, self._start, self._n, self._elem, self._layout = b, start, n, elem, layout

    def __getitem__(self, i: int) -> StructBuilder:
        i = self._index(i)
        layout = self._layout
        if layout is None:
            raise TypeError("only lists of structs are read back while built")
        start = self._start + i * (layout.data_words + layout.ptrs)
        return StructBuilder(self._b, start * 8, layout.data_words, start + layout.data_words,
                             layout.ptrs, layout)  # fmt: skip

    def __setitem__(self, i: int, value: Any) -> None:
        i = self._index(i)
        kind, extra = self._elem
        b = self._b
        if kind == "text":
            b.put_bytes(self._start + i, str(value).encode(), text=True)
        elif kind == "data":
            b.put_bytes(self._start + i, bytes(value), text=False)
        elif kind == "cap":
            b.put_cap(self._start + i, value)
        elif kind == "bool":
            byte, bit = self._start * 8 + (i >> 3), 1 << (i & 7)
            b.buf[byte] = b.buf[byte] | bit if value else b.buf[byte] & ~bit & 0xFF
        elif kind in SCALARS:
            st = SCALARS[kind]
            v = _enum_value(extra, value) if kind == "enum" else value
            st.pack_into(b.buf, self._start * 8 + i * st.size, v)
        elif kind == "list":
            items = list(value)
            inner = b.init_list(self._start + i, extra, len(items))
            for j, item in enumerate(items):
                inner[j] = item
        else:
            raise TypeError(f"a list of {kind}: set its elements with init()")
