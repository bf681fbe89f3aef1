"""A module loaded from its file, for the tests of scripts that are not in a package (the guest
image's build, its layout generator) and of another test file's helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(name: str, path: Path | str) -> ModuleType:
    """The module at path, as sys.modules[name]; its own directory is on sys.path meanwhile
    (build.py imports _plan beside it)."""
    here = str(Path(path).parent)
    sys.path.insert(0, here)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(here)
