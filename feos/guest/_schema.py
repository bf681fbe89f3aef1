"""schema/guest.capnp, loaded once, and the Status <-> FeosError conversions both ends use."""

from __future__ import annotations

import os
from typing import Any

import capnp  # type: ignore[import-untyped]

from feos.errors import Code, FeosError

# Every loader of schema/ must name files by the same absolute path and import path: pycapnp
# aborts the process on a file it meets twice under two names (Duplicate ID).
# feos/guest/_schema.py -> the root that holds feos/ and schema/ (the repo, or /usr/lib/feos-guest)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_DIR = os.path.join(_ROOT, "schema")

guest: Any = capnp.load(os.path.join(SCHEMA_DIR, "guest.capnp"), imports=[SCHEMA_DIR])


def code_name(code: Code) -> str:
    """INVALID_ARGUMENT -> invalidArgument, as schema/common.capnp names the enum's values."""
    first, *rest = code.name.lower().split("_")
    return first + "".join(w.capitalize() for w in rest)


_BY_NAME = {code_name(c): c for c in Code}


def fill_status(status: Any, error: FeosError) -> None:
    status.code = code_name(error.code)
    status.message = error.message
    if error.busy:
        status.init("vmBusy")


def raise_status(status: Any) -> None:
    """Raises the FeosError a non-ok Status stands for."""
    name = str(status.code)
    if name == "ok":
        return
    code = _BY_NAME.get(name, Code.UNKNOWN)
    raise FeosError(code, str(status.message), busy=bool(status._has("vmBusy")))
