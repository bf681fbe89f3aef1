"""A microVM's serial console, read back: the guest's serial.log since its last boot.

The drivers write the guest's console into serial.log in the microVM's directory (QEMU's
-serial stdio, Firecracker's stdout). `SerialLog` reads it from an offset on: what is there, and
with `follow`, what the VMM appends later, checked every FOLLOW_S (the file is a plain file the
VMM writes, with no one to tell a reader it grew). A boot truncates the file: a reader past the
new end starts again from the top.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from ..errors import Code, FeosError
from ._jail import Jail

CHUNK = 64 * 1024
FOLLOW_S = 0.2


def serial_log_path(state_dir: Path, driver: str, vm_id: str) -> Path:
    """Where the driver named `driver` writes the microVM's console."""
    if driver == "firecracker":
        return Jail(state_dir, vm_id).root / "serial.log"
    return state_dir / "vms" / "qemu" / vm_id / "serial.log"


def _read_from(path: Path, offset: int) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < offset:
                offset = 0  # truncated by a boot: from the top
            f.seek(offset)
            data = f.read(CHUNK)
    except FileNotFoundError:
        return b"", offset
    return data, offset + len(data)


class SerialLog:
    """A ByteStream (read only) over serial.log; `alive()` says whether more may come."""

    def __init__(self, path: Path, follow: bool, alive: Any = None) -> None:
        self.path = path
        self.follow = follow
        self._alive = alive or (lambda: False)
        self._offset = 0

    async def read(self, params: dict[str, Any]) -> dict[str, Any]:
        while True:
            data, self._offset = await trio.to_thread.run_sync(_read_from, self.path, self._offset)
            if data:
                return {"stdout": data, "stderr": b""}
            if not self.follow or not self._alive():
                return {"stdout": b"", "stderr": b"", "exited": True, "exitCode": 0}
            await trio.sleep(FOLLOW_S)

    async def write(self, params: dict[str, Any]) -> dict[str, Any]:
        raise FeosError(Code.FAILED_PRECONDITION, "the console log has no input")
