"""diskctl: a look at diskd (info, disks, layers, disk ID) and a collect, as JSON lines.

It talks to diskd's socket on asyncio (pycapnp's own loop): no trio in its start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import capnp

from ..errors import FeosError
from ._client import DiskdConnection

COMMANDS = {
    "info": ("info", "info"),
    "disks": ("listDisks", "disks"),
    "layers": ("listLayers", "layers"),
    "disk": ("getDisk", "disk"),
    "collect": ("collect", None),
}
EXIT = {"NOT_FOUND": 4, "INVALID_ARGUMENT": 2, "UNAVAILABLE": 3}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diskctl", description="Look at diskd.")
    p.add_argument("--socket", type=Path, default=Path("/var/lib/feos/disk/diskd.sock"),
                   help="diskd's socket (default /var/lib/feos/disk/diskd.sock)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="diskd's version, state directory, object store, ublk")
    sub.add_parser("disks", help="every disk, one a line")
    sub.add_parser("layers", help="every layer, one a line")
    disk = sub.add_parser("disk", help="one disk")
    disk.add_argument("id")
    sub.add_parser("collect", help="remove the layers no disk stands on")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> Any:
    method, field = COMMANDS[args.command]
    params = {"id": args.id} if args.command == "disk" else {}
    connection = await DiskdConnection.connect(str(args.socket))
    try:
        answer = await connection.call(method, **params)
    finally:
        connection.close()
    return answer if field is None else answer[field]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        value = asyncio.run(capnp.run(run(args)))
    except FeosError as exc:
        print(f"diskctl: {exc.code.name}: {exc.message}", file=sys.stderr)
        sys.exit(EXIT.get(exc.code.name, 1))
    for item in value if isinstance(value, list) else [value]:
        print(json.dumps(item, sort_keys=True))
