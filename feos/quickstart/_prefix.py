"""The quickstart's pod prefix: a ULA /64 (RFC 4193) made once and kept in its directory.

RFC 4193's fd00::/8 with a 40-bit global ID drawn at random (section 3.2) and subnet 0: a prefix
that is this node's alone with overwhelming odds and is routed nowhere outside it. It is written
to `prefix` in the quickstart's directory the first time and read back every time after, so the
pods keep their addresses from one run to the next.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from feos.errors import Code, FeosError

GLOBAL_ID_BITS = 40


def ula_prefix(global_id: int, subnet: int = 0) -> ipaddress.IPv6Network:
    """fdXX:XXXX:XXXX:SSSS::/64 for a 40-bit global ID and a 16-bit subnet ID."""
    if not 0 <= global_id < 1 << GLOBAL_ID_BITS or not 0 <= subnet < 1 << 16:
        raise ValueError("a ULA needs a 40-bit global ID and a 16-bit subnet ID")
    high = (0xFD << 56) | (global_id << 16) | subnet
    return ipaddress.IPv6Network((high << 64, 64))


def kept_prefix(path: Path) -> tuple[ipaddress.IPv6Network, bool]:
    """The prefix kept at `path`, made (and written whole) if there is none; True if made now."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        prefix = ula_prefix(secrets.randbits(GLOBAL_ID_BITS))
        _write_whole(path, f"{prefix}\n")
        return prefix, True
    try:
        return ipaddress.IPv6Network(text), False
    except ValueError as e:
        raise FeosError(Code.FAILED_PRECONDITION, f"{path}: not an IPv6 prefix ({e})") from e


def _write_whole(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
