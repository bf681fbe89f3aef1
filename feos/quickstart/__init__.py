"""The quickstart: one command from a fresh machine to a running pod that serves a web page.

`hack/run` (after hack/install and the guest image) runs `python -m feos.quickstart`. It sets up
what a first pod needs on one machine, each part found again on the next run rather than made
twice: a ULA pod prefix kept in its directory (_prefix), a local registry holding a demo image
built from Debian's busybox-static (_registry, _image), feosd on the quickstart's own defaults
(_feosd), and the demo pod publishing its HTTP server on a port of the node (_demo). It prints
where the page is and how to go on, waits for Ctrl-C or SIGTERM, then stops in order (_run).

These defaults are the quickstart's, not feosd's: feosd itself still refuses a pod with a network
when it has no prefix. Everything it keeps is under one directory (./local unless --dir or
FEOS_QUICKSTART_DIR say otherwise): feosd's `state/` and `run/`, and `quickstart/` (the prefix,
the registry's data, the image's OCI layout, feosd's log).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from feos.errors import FeosError

from ._prefix import kept_prefix, ula_prefix
from ._run import Options, run

__all__ = ["Options", "kept_prefix", "main", "parse", "run", "ula_prefix"]


def parse(argv: Sequence[str] | None = None) -> Options:
    """The quickstart's options; what it does not know goes to feosd as it is."""
    # no abbreviations: feosd's --web must not be taken for --web-port
    p = argparse.ArgumentParser(prog="hack/run", description=__doc__.split("\n")[0],
                                allow_abbrev=False,
                                epilog="Other arguments are feosd's, passed on (feosd --help).")
    env = os.environ.get
    p.add_argument("--dir", type=Path, default=Path(env("FEOS_QUICKSTART_DIR", "local")),
                   help="where everything is kept (default ./local, or $FEOS_QUICKSTART_DIR)")
    p.add_argument("--port", type=int, default=int(env("FEOS_QUICKSTART_PORT", "8080")),
                   help="the node's port published to the demo pod (default 8080)")
    p.add_argument("--web-port", type=int, default=int(env("FEOS_QUICKSTART_WEB_PORT", "8081")),
                   help="the web console's port on 127.0.0.1, when feosd has one (default 8081)")
    known, rest = p.parse_known_args(argv)
    return Options(known.dir.resolve(), known.port, known.web_port, tuple(rest))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(parse(argv))
    except FeosError as e:
        print(f"quickstart: {e}", file=sys.stderr)
        return 1
