"""The Cap'n Proto schemas of schema/, loaded once per process.

The schema directory is found beside the package (a checkout or an editable install) or where
FEOS_SCHEMA_DIR says (an installed package ships it as data).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import capnp  # type: ignore[import-untyped]

capnp.remove_import_hook()


def schema_dir() -> Path:
    override = os.environ.get("FEOS_SCHEMA_DIR")
    if override:
        return Path(override)
    for candidate in (Path(__file__).parent / "schema", Path(__file__).parent.parent / "schema"):
        if (candidate / "common.capnp").exists():
            return candidate
    raise RuntimeError("the Cap'n Proto schemas are missing: set FEOS_SCHEMA_DIR")


@functools.cache
def load(name: str) -> Any:
    """The module of schema/<name>.capnp."""
    directory = schema_dir()
    return capnp.load(str(directory / f"{name}.capnp"), imports=[str(directory)])


def common() -> Any:
    return load("common")


def pod() -> Any:
    return load("pod")


def volume() -> Any:
    return load("volume")


def network() -> Any:
    return load("network")


def host() -> Any:
    return load("host")


def api() -> Any:
    return load("feos")
