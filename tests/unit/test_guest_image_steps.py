"""packaging/guest/build.py's progress: a line on stderr a step as it passes, with its time."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

_BUILD = Path(__file__).resolve().parents[2] / "packaging/guest/build.py"


def _load() -> ModuleType:
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("feos_guest_build_steps", _BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = before
    return module


build = _load()
LINE = re.compile(r"guest-image: +\d+\.\ds (.+) (done in|failed after) \d+\.\ds\Z")


def test_each_step_a_line_with_its_time_and_a_failure_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with build.step("initramfs"):
        pass
    with pytest.raises(OSError, match="mirror"), build.step("debootstrap"):
        raise OSError("the mirror is gone")
    out, err = capsys.readouterr()
    assert out == ""  # stdout carries the installed path alone
    got = [LINE.match(line) for line in err.splitlines()]
    assert [(m[1], m[2]) for m in got if m] == [("initramfs", "done in"),
                                               ("debootstrap", "failed after")]  # fmt: skip
    assert all(got)
