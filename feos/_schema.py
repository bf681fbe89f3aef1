"""The Cap'n Proto schemas of schema/, loaded once per process: the node's one loader.

Every pycapnp user on the node (the API, the records, the guest link's client) loads its schema
here: pycapnp aborts the process on a file it meets twice under two paths (Duplicate ID), so
there must be one directory and one import path. The guest's agent does not use pycapnp (its
layout is generated: feos/guest/_layout.py).

The schema directory is found beside the package (a checkout or an editable install) or where
FEOS_SCHEMA_DIR says (an installed package ships it as data).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import capnp

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


def template() -> Any:
    return load("template")


def guest() -> Any:
    return load("guest")


def disk() -> Any:
    return load("disk")


def api() -> Any:
    return load("feos")
