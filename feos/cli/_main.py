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
from ..rpc import Client, is_socket_path
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
    tls = p.add_argument_group("TLS, for a HOST:PORT feosd serves with --tcp-client-ca")
    for flag, env, text in (
        ("--tls-cert", "FEOS_TLS_CERT", "this client's certificate chain (PEM): TLS on"),
        ("--tls-key", "FEOS_TLS_KEY", "its key (PEM; default: in the --tls-cert file)"),
        ("--tls-ca", "FEOS_TLS_CA", "the CAs (PEM) feosd's certificate is checked against "
         "(default: the system's)"),
        ("--tls-pin", "FEOS_TLS_PIN", "feosd's key's pin instead of a CA: the one feosd logs "
         "for its own certificate"),
        ("--tls-server-name", "FEOS_TLS_SERVER_NAME", "the name feosd's certificate must carry "
         "(default: HOST)"),
    ):
        tls.add_argument(flag, default=os.environ.get(env) or None, metavar="VALUE",
                         help=f"{text} (${env})")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    nouns = p.add_subparsers(dest="noun", required=True, metavar="NOUN")
    for register in _commands.NOUNS:
        register(nouns)
    return p


def client_tls(args: argparse.Namespace) -> Any:
    """The TLS of the TCP connection (a ClientTls), or None for a plain one or a socket path."""
    if is_socket_path(args.socket):
        return None
    if args.tls_cert is None:
        for flag in ("tls_key", "tls_ca", "tls_pin", "tls_server_name"):
            if getattr(args, flag) is not None:
                raise _commands.UsageError(f"--{flag.replace('_', '-')}: needs --tls-cert "
                                           "(feosd over TLS asks every client for a certificate)")
        return None
    if args.tls_pin is not None and args.tls_ca is not None:
        raise _commands.UsageError("--tls-pin: contradicts --tls-ca (one way to check feosd)")
    from pathlib import Path

    from ..rpc import ClientTls

    return ClientTls(Path(args.tls_cert), Path(args.tls_key) if args.tls_key else None,
                     Path(args.tls_ca) if args.tls_ca else None, args.tls_pin,
                     args.tls_server_name)


async def _run(args: argparse.Namespace) -> int:
    client = await Client.connect(args.socket, client_tls(args))
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
