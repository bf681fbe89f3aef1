"""ublk's structures and numbers in feos.native against the kernel's own header.

The module is compiled against <linux/ublk_cmd.h>, so its layout is the compiler's; these tests
check it against the header read independently: its #defines, and each structure rebuilt with
ctypes from the header's field list (ctypes lays structures out by the C ABI on its own). The
ublk I/O loop itself cannot run here: the host has no ublk_drv (docs/disk.md, "ublk").
"""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import pytest

from feos import native

HEADER = Path("/usr/include/linux/ublk_cmd.h")
TYPES = {"__u8": ctypes.c_uint8, "__u16": ctypes.c_uint16, "__u32": ctypes.c_uint32,
         "__u64": ctypes.c_uint64, "__s32": ctypes.c_int32}

pytestmark = pytest.mark.skipif(not native.available(), reason="feos._native is not built")


def header() -> str:
    return HEADER.read_text()


def header_structs() -> dict[str, type[ctypes.Structure]]:
    made: dict[str, type[ctypes.Structure]] = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\n\};", header(), re.S):
        fields: list[tuple[str, object]] = []
        for kind, field, count in re.findall(r"^\s*(__[us]\d+|struct \w+)\s+(\w+)(?:\[(\d+)\])?;",
                                             body, re.M):
            ctype = made[kind.split()[1]] if kind.startswith("struct") else TYPES[kind]
            fields.append((field, ctype * int(count) if count else ctype))
        made[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return made


def test_every_number_is_the_headers() -> None:
    defined = {name: int(value, 0) for name, value in
               re.findall(r"#define\s+(UBLK_\w+)\s+\(?(0x[0-9a-fA-F]+|\d+)\)?\s*$", header(), re.M)}
    shifted = {name: 1 << int(bit) for name, bit in
               re.findall(r"#define\s+(UBLK_\w+)\s+\(1U? << (\d+)\)", header(), re.M)}
    ours = native.ublk_constants()
    assert len(ours) >= 20
    assert ours == {name: {**defined, **shifted}[name] for name in ours}


@pytest.mark.parametrize("name", native.UBLK_STRUCTS)
def test_each_structure_is_laid_out_as_the_header_says(name: str) -> None:
    rebuilt = header_structs()[name]
    size, offsets = native.ublk_layout(name)
    assert size == ctypes.sizeof(rebuilt)
    for field, offset in offsets.items():
        assert offset == getattr(rebuilt, field).offset, field


def test_the_commands_as_newer_kernels_number_them() -> None:
    # linux/ublk_cmd.h from 6.4 on: UBLK_U_CMD_ADD_DEV, UBLK_U_IO_FETCH_REQ, ...
    c = native.ublk_constants()
    assert native.ublk_ioctl(c["UBLK_CMD_ADD_DEV"], "ublksrv_ctrl_cmd") == 0xC0207504
    assert native.ublk_ioctl(c["UBLK_CMD_START_DEV"], "ublksrv_ctrl_cmd") == 0xC0207506
    assert native.ublk_ioctl(c["UBLK_IO_FETCH_REQ"], "ublksrv_io_cmd") == 0xC0107520
    assert native.ublk_ioctl(c["UBLK_IO_COMMIT_AND_FETCH_REQ"], "ublksrv_io_cmd") == 0xC0107521


def test_a_control_command_and_an_io_descriptor_in_bytes() -> None:
    raw = native.ublk_ctrl_cmd(7, queue_id=3, length=64, addr=0x1000, data=(5, 6))
    assert struct.unpack("<IHHQQQ", raw) == (7, 3, 64, 0x1000, 5, 6)
    desc = struct.pack("<IIQQ", native.ublk_constants()["UBLK_IO_OP_WRITE"] | (0x20 << 8), 8,
                       2048, 0x7F0000)
    assert native.ublk_io_desc(desc) == (1, 0x20, 8, 2048, 0x7F0000)
    with pytest.raises(ValueError, match="24 bytes"):
        native.ublk_io_desc(b"short")
    with pytest.raises(ValueError, match="not a ublk structure"):
        native.ublk_layout("not_ublk")


def test_the_driver_is_missing_here() -> None:
    from feos.disk._service import ublk_status

    if Path("/dev/ublk-control").exists():
        pytest.skip("this host has ublk_drv")
    assert ublk_status().startswith("unavailable: the kernel has no ublk_drv")
