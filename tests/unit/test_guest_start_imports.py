"""What the agent's start imports of the guest's own modules: neither typing nor re.

Under QEMU's TCG typing's import (which pulls in re) costs the guest's start about 80 ms, and
compiling _validate's regexes more: the modules the start imports name their types for mypy only
(TYPE_CHECKING) and compile their patterns on first use.

Each check runs in a fresh interpreter started as the image's launcher starts the agent
(python -S -E, the repo put on sys.path by hand), so that nothing this process imported hides an
import. feos/__init__.py and feos/guest/__init__.py import nothing. The modules that import
asyncio (_proc, and _containers, _system, _link through it) are imported inside
`_lean.imports()`, as feos.guest.__main__ imports them: the plain asyncio package imports typing
itself (asyncio.staggered, asyncio.timeouts), the lean one does not.

Also here: _netlink.Record, typing.NamedTuple's stand-in at run time, against typing.NamedTuple.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from feos.guest._netlink import Record

REPO = Path(__file__).resolve().parents[2]

# The modules the start imports that import no asyncio, and those that do.
PLAIN = ("feos.errors", "feos.guest._validate", "feos.guest._netlink", "feos.guest._hello",
         "feos.guest._oci", "feos.guest._token")  # fmt: skip
WITH_ASYNCIO = ("feos.guest._proc", "feos.guest._images", "feos.guest._containers",
                "feos.guest._system", "feos.guest._link")  # fmt: skip

# (json imports re: the program imports it only to print what it saw)
PRELUDE = """
import importlib, sys
sys.path[0:0] = [sys.argv[1]]
def loaded():
    return sorted(name for name in ("typing", "re") if name in sys.modules)
def report(seen):
    import json
    print(json.dumps(seen))
"""


def run(program: str, *modules: str) -> dict[str, object]:
    """The JSON the program prints on its last line, in a fresh python -S -E."""
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", PRELUDE + program, str(REPO), *modules],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_interpreter_alone_imports_neither() -> None:
    # Else the checks below would prove nothing.
    assert run("report({'loaded': loaded()})") == {"loaded": []}


def test_the_modules_without_asyncio_import_neither() -> None:
    program = """
for name in sys.argv[2:]:
    importlib.import_module(name)
report({"loaded": loaded()})
"""
    assert run(program, *PLAIN) == {"loaded": []}


def test_the_start_imports_neither_and_validation_loads_re_when_used() -> None:
    program = """
from feos.guest import _lean
with _lean.imports():
    import asyncio
    for name in sys.argv[2:]:
        importlib.import_module(name)
seen = {"start": loaded()}
from feos.errors import FeosError
from feos.guest import _validate, _system
plan = _system.network_plan("eth0", 1, 2, "fd00::2", True, "10.0.0.2", 1400)  # no regex
seen["plan"] = [step.name for step in plan][:2] + [loaded()]
seen["name"] = _validate.container_name("c", "web-1")
seen["after"] = loaded()
try:
    _validate.container_name("c", "-web")
except FeosError as e:
    seen["bad"] = e.message
ref = _validate.reference("r", "registry.example:5000/team/app:1.2")
seen["ref"] = [ref.registry, ref.repository, ref.tag]
report(seen)
"""
    seen = run(program, *PLAIN, *WITH_ASYNCIO)
    assert seen["start"] == []
    assert seen["plan"] == ["link up lo", "link up eth0 mtu 1400", []]
    assert seen["name"] == "web-1"
    assert seen["after"] == ["re"]  # and still no typing
    assert str(seen["bad"]).startswith("c: 1 to 63 lowercase")
    assert seen["ref"] == ["registry.example:5000", "team/app", "1.2"]


class Typed(NamedTuple):
    name: str
    kind: int
    payload: bytes
    missing_ok: bool = False


class Plain(Record):
    name: str
    kind: int
    payload: bytes
    missing_ok: bool = False


def test_a_record_behaves_as_a_named_tuple() -> None:
    for cls in (Typed, Plain):
        r = cls("up", 16, b"\1")
        assert r == ("up", 16, b"\1", False) and isinstance(r, tuple)
        assert hash(r) == hash(("up", 16, b"\1", False))
        assert (r.name, r.kind, r.payload, r.missing_ok) == tuple(r)
        assert cls("up", 16, payload=b"\1", missing_ok=True).missing_ok is True
        assert cls(name="up", kind=16, payload=b"\1") == r
        assert cls._fields == ("name", "kind", "payload", "missing_ok")
        assert cls._field_defaults == {"missing_ok": False}
        assert r._replace(kind=17) == ("up", 17, b"\1", False)
        assert r._asdict() == {"name": "up", "kind": 16, "payload": b"\1", "missing_ok": False}
        assert copy.copy(r) == r and pickle.loads(pickle.dumps(r)) == r
        assert type(pickle.loads(pickle.dumps(r))) is cls
        assert repr(r) == f"{cls.__name__}(name='up', kind=16, payload=b'\\x01', missing_ok=False)"
        with pytest.raises(AttributeError):
            r.name = "down"  # type: ignore[misc]
        with pytest.raises(AttributeError):
            r.other = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("up",), {}), (("up", 16, b"", False, 1), {}), (("up", 16), {"name": "x", "payload": b""}),
     (("up", 16, b""), {"other": 1})],
)  # fmt: skip
def test_a_record_refuses_what_a_named_tuple_refuses(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    for cls in (Typed, Plain):
        with pytest.raises(TypeError):
            cls(*args, **kwargs)
