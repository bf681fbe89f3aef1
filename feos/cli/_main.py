"""feosctl: the operator's command line over feosd's API.

`feosctl [--socket PATH] [--json] NOUN VERB ...`. Tables for people, --json for scripts. A failed
call prints one line, `feosctl: CODE: message`, and exits with 10 + the status code (docs/api.md
lists them), so a script can tell NOT_FOUND (15) from ALREADY_EXISTS (16) without parsing prose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import capnp

from ..errors import Code, FeosError
from ..rpc import Client
from . import _commands
from ._pods import ExitWith

EXIT_BASE = 10
DEFAULT_SOCKET = "/run/feos/api.sock"


def exit_code(code: Code) -> int:
    return EXIT_BASE + int(code)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="feosctl",
        description="Drive feosd: pods, volumes, security groups, name tables and the host.",
    )
    p.add_argument(
        "--socket",
        default=os.environ.get("FEOS_SOCKET", DEFAULT_SOCKET),
        help=f"feosd's API: a socket path or HOST:PORT (default $FEOS_SOCKET or {DEFAULT_SOCKET})",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    nouns = p.add_subparsers(dest="noun", required=True, metavar="NOUN")
    for register in _commands.NOUNS:
        register(nouns)
    return p


async def _run(args: argparse.Namespace) -> int:
    client = await Client.connect(args.socket)
    try:
        result = await args.handler(client, args)
    finally:
        client.close()
    _commands.output(args, result)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = asyncio.run(capnp.run(_run(args)))
    except FeosError as exc:
        print(f"feosctl: {exc.code.name}: {exc.message}", file=sys.stderr)
        code = exit_code(exc.code)
    except ExitWith as exc:
        code = exc.code
    except _commands.UsageError as exc:
        print(f"feosctl: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = 0
    if argv is None:
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    """The command line's exit without the interpreter's teardown (its modules, pycapnp's loop
    and objects: 20 ms of every feosctl's CPU, which ten at once on two cores wait for). Only
    as the program (argv from the command line): a caller that passes argv gets SystemExit."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    os._exit(code)


Handler = Callable[[Client, argparse.Namespace], Coroutine[Any, Any, Any]]
__all__ = ["Handler", "json", "main"]
