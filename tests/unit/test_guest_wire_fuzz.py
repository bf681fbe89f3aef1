"""The guest's Cap'n Proto reader (feos.guest._wire) on damaged messages, and held to pycapnp.

Valid messages of the guest's structs, built by pycapnp (one segment, or many with far pointers)
and by _wire, are damaged: bits flipped, bytes and words overwritten, words inserted and
deleted (the segment table kept in step, so the damage reaches the pointers), a list pointer's
element size or a struct pointer's sizes changed. Read whole as every struct of the layout, the
only exception is WireError; and read as the struct they were built as, what both pycapnp and
_wire take reads the same through both, and what pycapnp refuses _wire refuses too.

Also: a field of an element of a list of narrow structs (1, 2 or 4 bytes) reads the element or
its default, never the next element, and the last element's never runs off the segment.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import capnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.guest import _layout, _wire

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = capnp.load(f"{REPO}/schema/guest.capnp", imports=[f"{REPO}/schema"])
RELEASE = _layout.NAMES["rpc.capnp:Release"]  # id :UInt32 @0, referenceCount :UInt32 @1
FINISH = _layout.NAMES["rpc.capnp:Finish"]  # questionId :UInt32, two bools defaulting to true


def _word(w: int) -> bytes:
    return w.to_bytes(8, "little")


def _narrow_list(size_code: int, elements: bytes) -> _wire.Message:
    """A message whose root is a list pointer to `elements`, of element size `size_code`."""
    bits = _wire._ELEMENT_BITS[size_code]
    count = len(elements) * 8 // bits
    seg = _word(1 | size_code << 32 | count << 35) + elements + bytes(-len(elements) % 8)
    return _wire.Message([seg])


def _read_list(msg: _wire.Message, struct_id: int) -> Any:
    return _wire.read_pointer(msg, 0, 0, ("list", ("struct", struct_id)), 0)


@pytest.mark.parametrize(("size_code", "width"), [(2, 1), (3, 2), (4, 4)])
def test_a_narrow_struct_element_reads_only_itself(size_code: int, width: int) -> None:
    # Two elements filling the list's last word exactly: element 1's far fields would run past
    # the segment, element 0's into element 1.
    elements = bytes(range(1, 9))
    values = _read_list(_narrow_list(size_code, elements), RELEASE)
    assert len(values) == 8 // width
    for i, r in enumerate(values):
        mine = elements[i * width : (i + 1) * width]
        ident = int.from_bytes(mine, "little") if width == 4 else 0  # a u32 needs 4 bytes
        assert (r.id, r.referenceCount) == (ident, 0)
    finishes = _read_list(_narrow_list(size_code, bytes(8)), FINISH)
    assert all(f.releaseResultCaps and f.requireEarlyCancellationWorkaround for f in finishes)
    last = finishes[len(finishes) - 1]
    assert last.to_dict() == {"questionId": 0, "releaseResultCaps": True,
                              "requireEarlyCancellationWorkaround": True}  # fmt: skip


def test_an_eight_byte_element_reads_its_whole_word() -> None:
    (r,) = _read_list(_narrow_list(5, struct.pack("<II", 7, 9)), RELEASE)
    assert (r.id, r.referenceCount) == (7, 9)


def test_a_list_of_empty_elements_costs_a_word_each() -> None:
    # 2**29 - 1 zero-sized structs in no words: the reader's budget refuses it, as C++'s does.
    tag = _wire._struct_pointer(2**29 - 1, 0, 0)
    for seg in (_word(1 | 7 << 32) + _word(tag), _word(1 | 0 << 32 | (2**29 - 1) << 35)):
        with pytest.raises(_wire.WireError, match="amplification"):
            _read_list(_wire.Message([seg]), RELEASE)


def test_text_that_is_not_utf8_is_a_wire_error() -> None:
    msg = PY.VolumeMount.new_message(name="ab", path="/p").to_bytes()
    bad = msg.replace(b"ab\0", b"\xff\xfe\0")
    with pytest.raises(_wire.WireError, match="not UTF-8"):
        _wire.Message.from_frame(bad).root(_wire.Layout.named("guest.capnp:VolumeMount")).to_dict()


def test_a_frame_short_of_its_segments_is_a_wire_error() -> None:
    frame = PY.VolumeMount.new_message(name="ab").to_bytes()
    for cut in (0, 3, 8, len(frame) - 8):
        with pytest.raises(_wire.WireError):
            _wire.Message.from_frame(frame[:cut])


# Valid messages ---------------------------------------------------------------------------------

texts = st.text(max_size=12)
mounts = st.lists(st.fixed_dictionaries({"name": texts, "path": texts, "readOnly": st.booleans()}),
                  max_size=3)  # fmt: skip
configs = st.fixed_dictionaries({
    "name": texts, "image": texts, "command": st.lists(texts, max_size=3),
    "env": st.lists(texts, max_size=3), "volumeMounts": mounts, "pullToken": texts,
    "workingDir": texts,
})  # fmt: skip
states = st.fixed_dictionaries({
    "name": texts, "image": texts, "imageDigest": texts,
    "status": st.sampled_from(["created", "running", "stopped"]), "pid": st.integers(0, 2**32 - 1),
    "exitCode": st.integers(-(2**31), 2**31 - 1), "createdNs": st.integers(-(2**63), 2**63 - 1),
})  # fmt: skip
networks = st.fixed_dictionaries({
    "ipv6": texts, "ipv4": texts, "resolvers": st.lists(texts, max_size=3),
    "mtu": st.integers(0, 65535), "mac": texts,
})  # fmt: skip
volumes = st.lists(st.fixed_dictionaries({
    "name": texts, "id": texts, "drive": st.integers(0, 255), "sizeBytes": st.integers(0, 2**64 - 1),
    "format": st.booleans(),
}), max_size=3)  # fmt: skip

# (display name in _layout, pycapnp's struct, values)
KINDS: list[tuple[str, Any, Any]] = [
    ("guest.capnp:ContainerConfig", PY.ContainerConfig, configs),
    ("guest.capnp:ContainerState", PY.ContainerState, states),
    ("guest.capnp:NetworkConfig", PY.NetworkConfig, networks),
    ("guest.capnp:GuestService.mountVolumes$Params",
     capnp.lib.capnp._StructModule(PY.GuestService.schema.methods["mountVolumes"].param_type,
                                   "mountVolumes$Params"),
     volumes.map(lambda v: {"volumes": v})),
    ("guest.capnp:GuestService.listContainers$Results",
     capnp.lib.capnp._StructModule(PY.GuestService.schema.methods["listContainers"].result_type,
                                   "listContainers$Results"),
     st.lists(states, max_size=3).map(lambda c: {"containers": c,
                                                 "status": {"code": "ok", "message": "m"}})),
]  # fmt: skip


def _frame(segments: list[bytes]) -> bytes:
    head = struct.pack(f"<{len(segments) + 1}I", len(segments) - 1,
                       *(len(s) // 8 for s in segments))  # fmt: skip
    return head + bytes(-len(head) % 8) + b"".join(segments)


def _by_pycapnp(py: Any, value: dict[str, Any], first: int | None) -> list[bytes]:
    if first is None:
        return [bytes(s) for s in py.new_message(**value).to_segments()]
    builder = capnp._MallocMessageBuilder(first)  # a tiny first segment: the rest go far
    builder.init_root(py).from_dict(value)
    return [bytes(s) for s in builder.get_segments_for_output()]


def _by_wire(name: str, value: dict[str, Any]) -> list[bytes]:
    b = _wire.Builder()
    _fill(b.init_root(_wire.Layout.named(name)), value)
    return [bytes(b.buf)]


def _fill(target: Any, value: dict[str, Any]) -> None:
    for key, v in value.items():
        if isinstance(v, dict):
            _fill(target.init(key), v)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            out = target.init(key, len(v))
            for element, item in zip(out, v, strict=True):
                _fill(element, item)
        else:
            setattr(target, key, v)


@st.composite
def messages(draw: Any) -> tuple[str, Any, list[bytes]]:
    """(layout name, pycapnp struct, segments) of a valid message, by pycapnp or by _wire."""
    name, py, values = draw(st.sampled_from(KINDS))
    value = draw(values)
    source = draw(st.sampled_from(["pycapnp", "pycapnp-far", "wire"]))
    if source == "wire":
        return name, py, _by_wire(name, value)
    return name, py, _by_pycapnp(py, value, draw(st.integers(1, 4)) if source != "pycapnp" else None)


# Damage -----------------------------------------------------------------------------------------


def _pointer_damage(seg: bytearray, at: int, new: int) -> None:
    """A list pointer gets another element size, a struct pointer other section sizes."""
    w = int.from_bytes(seg[at * 8 : at * 8 + 8], "little")
    if w & 3 == 1:
        w = (w & ~(7 << 32)) | (new & 7) << 32
    elif w & 3 == 0 and w:
        w = (w & 0xFFFFFFFF) | (new & 0xFFFF) << 32 | (new >> 16 & 0xFFFF) << 48
    else:
        w ^= (new & 0xFFFFFFFF) << 32
    seg[at * 8 : at * 8 + 8] = w.to_bytes(8, "little")


def _damage(segments: list[bytes], ops: list[tuple[Any, ...]]) -> list[bytes]:
    segs = [bytearray(s) for s in segments]
    for kind, which, at, value in ops:
        seg = segs[which % len(segs)]
        if not seg:
            continue
        byte, word = at % len(seg), at % (len(seg) // 8 or 1)
        if kind == "flip":
            seg[byte] ^= 1 << (value % 8)
        elif kind == "byte":
            seg[byte] = value % 256
        elif kind == "word":
            seg[word * 8 : word * 8 + 8] = (value % 2**64).to_bytes(8, "little")
        elif kind == "insert":
            seg[word * 8 : word * 8] = (value % 2**64).to_bytes(8, "little")
        elif kind == "delete" and len(seg) > 8:
            del seg[word * 8 : word * 8 + 8]
        elif kind == "pointer":
            _pointer_damage(seg, word, value)
    return [bytes(s) for s in segs]


ops = st.lists(st.tuples(st.sampled_from(["flip", "byte", "word", "insert", "delete", "pointer"]),
                         st.integers(0, 7), st.integers(0, 4096), st.integers(0, 2**64 - 1)),
               min_size=1, max_size=4)  # fmt: skip


def _walk(value: Any) -> Any:
    """Every field, read (a struct as a dict, a list as a list)."""
    if isinstance(value, _wire.StructReader):
        return value.to_dict()
    if isinstance(value, _wire.ListReader):
        return [_walk(v) for v in value]
    return value


def _ours(frame: bytes, name: str) -> Any:
    n = _wire.frame_size(frame)
    return _walk(_wire.Message.from_frame(frame[:n]).root(_wire.Layout.named(name)))


STRUCT_NAMES = sorted(n for n, i in _layout.NAMES.items() if i in _layout.STRUCTS)


@given(messages(), ops)
@settings(max_examples=600, deadline=None)
def test_damaged_messages_end_in_a_wire_error(message: Any, damage: Any) -> None:
    _, _, segments = message
    frame = _frame(_damage(segments, damage))
    for name in STRUCT_NAMES:  # read as every struct: a wrong type is damage too
        try:
            _ours(frame, name)
        except _wire.WireError:
            pass


@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_damaged_frame_headers_end_in_a_wire_error(body: bytes, count: int) -> None:
    frame = struct.pack("<I", count) + body
    try:
        n = _wire.frame_size(frame)
        _wire.Message.from_frame(frame[: n or len(frame)])
    except _wire.WireError:
        pass


# The oracle ----------------------------------------------------------------------------------


def _theirs(frame: bytes, py: Any) -> Any:
    with py.from_bytes(frame, traversal_limit_in_words=1 << 20) as r:
        return _py_plain(r)


def _py_plain(value: Any) -> Any:
    """pycapnp's reader as the plain values _wire's to_dict gives: every field, defaults too."""
    if isinstance(value, capnp.lib.capnp._DynamicStructReader):
        names = list(value.schema.non_union_fields)
        if value.schema.union_fields:
            names.append(value.which())
        fields = value.schema.fields
        return {f: _py_plain(getattr(value, f)) for f in names
                if not (_is_struct(fields[f]) and not value._has(f))}
    if isinstance(value, capnp.lib.capnp._DynamicListReader):
        return [_py_plain(v) for v in value]
    if isinstance(value, capnp.lib.capnp._DynamicEnum):
        try:
            return value._as_str()
        except RuntimeError:  # a value the schema does not name: _wire gives the number
            return value.raw
    return value


def _is_struct(field: Any) -> bool:
    proto = field.proto
    return bool(proto.which() == "slot" and proto.slot.type.which() == "struct")


REFUSED = "refused"


@given(messages(), ops)
@settings(max_examples=600, deadline=None)
def test_damaged_messages_read_as_pycapnp_reads_them(message: Any, damage: Any) -> None:
    name, py, segments = message
    frame = _frame(_damage(segments, damage))
    try:
        ours = _ours(frame, name)
    except _wire.WireError as e:
        if "amplification" in str(e):
            return  # _wire's budget is the message's own size, C++'s a fixed 8 Mi words
        ours = REFUSED
    try:
        theirs = _theirs(frame, py)
    except (capnp.KjException, UnicodeDecodeError):
        theirs = REFUSED
    assert ours == theirs
