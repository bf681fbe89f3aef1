"""The compiled schema of the guest image (feos.guest._schema.load_compiled, build.compile_schemas).

The image ships guest.capnp compiled by Debian's capnp (a CodeGeneratorRequest) and the agent
loads it through pycapnp's SchemaLoader instead of parsing the files. Here: the module it makes
is the one capnp.load makes (every name, kind, id, field, method and enumerant), and an agent
started from a root laid out as the image's (feos/, schema/, compiled/, the launcher's sys.path)
loads it so and serves the node's client.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from feos.errors import Code, FeosError
from feos.guest import _schema
from feos.guest._client import GuestClient, NetworkConfig

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    sys.path.insert(0, str(path.parent))  # build.py imports _plan beside it
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


AgentProcess = _load(
    "feos_test_guest_service", REPO / "tests/unit/test_guest_service.py"
).AgentProcess


def _build() -> ModuleType:
    return _load("feos_guest_build", REPO / "packaging/guest/build.py")


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root laid out as the image's /usr/lib/feos-guest: the agent, schema/, compiled/."""
    if shutil.which("capnp") is None:
        pytest.fail("no capnp compiler: apt-get install capnproto (hack/packages.apt)")
    root = tmp_path_factory.mktemp("feos-guest")
    for src in [REPO / "feos/__init__.py", REPO / "feos/errors.py",
                *(REPO / "feos/guest").glob("*.py"), *(REPO / "schema").glob("*.capnp")]:  # fmt: skip
        dst = root / src.relative_to(REPO)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    _build().compile_schemas(REPO, root / "compiled")
    return root


def _shape(module: Any, depth: int = 0) -> dict[str, object]:
    """What a schema module holds, by name: kinds, ids, fields, methods, enumerants, nesting."""
    out: dict[str, object] = {}
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name in ("schema", "Reader", "Builder", "Server"):
            continue
        schema = getattr(value, "schema", None)
        facts: list[object] = [type(value).__name__]
        if schema is not None:
            facts.append(schema.node.id)
            for attr in ("fieldnames", "method_names_inherited", "enumerants"):
                if hasattr(schema, attr):
                    got = getattr(schema, attr)
                    facts.append(sorted(got) if not isinstance(got, dict) else sorted(got.items()))
        else:
            facts.append(repr(value))
        if depth < 6 and hasattr(value, "__dict__"):
            facts.append(_shape(value, depth + 1))
        out[name] = facts
    return out


def test_the_compiled_schema_makes_the_module_capnp_load_makes(image_root: Path) -> None:
    compiled = _schema.load("guest.capnp", str(image_root / "compiled"))
    assert hasattr(compiled, "_loader")  # from the loader, not parsed
    assert _shape(compiled) == _shape(_schema.guest)
    assert len(_shape(compiled)) > 5
    ping = compiled.GuestService.schema.methods["ping"]
    assert (
        ping.param_type.node.id
        == _schema.guest.GuestService.schema.methods["ping"].param_type.node.id
    )


def test_a_compiled_request_without_the_file_is_refused(image_root: Path) -> None:
    data = (image_root / "compiled/guest.capnp.bin").read_bytes()
    with pytest.raises(FeosError) as e:
        _schema.load_compiled(data, "pod.capnp", str(image_root / "compiled/request.capnp"))
    assert e.value.code == Code.INTERNAL


def test_without_compiled_schemas_the_files_are_parsed(tmp_path: Path) -> None:
    parsed = _schema.load("guest.capnp", str(tmp_path))  # an empty compiled dir
    assert not hasattr(parsed, "_loader")
    assert _shape(parsed) == _shape(_schema.guest)


@pytest.fixture(scope="module")
def image_agent(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The agent of image_root, run with the launcher's sys.path (the root, then site-packages)."""
    site = sysconfig.get_paths()["purelib"]
    a = AgentProcess(str(tmp_path_factory.mktemp("agent")),
                     prefix=["env", f"PYTHONPATH={image_root}:{site}"])  # fmt: skip
    try:
        yield a
    finally:
        a.close()
        assert "Traceback" not in a.output(), a.output()


def test_the_agent_of_the_image_layout_loads_compiled_and_serves(
    image_root: Path, image_agent: Any
) -> None:
    probe = subprocess.run(
        [sys.executable, "-S", "-E", "-c",
         "import sys; sys.path[0:0] = sys.argv[1:]; from feos.guest import _schema; "
         "print(_schema.__file__, hasattr(_schema.guest, '_loader'))",
         str(image_root), sysconfig.get_paths()["purelib"]],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.split() == [str(image_root / "feos/guest/_schema.py"), "True"]

    async def scenario(c: GuestClient) -> None:
        ping = await c.ping()
        assert ping.boot_id == c.boot_id
        attached = await asyncio.wait_for(c.attached, 5)
        assert attached.session == c.session
        with pytest.raises(FeosError) as e:  # a Status of common.capnp, through the loader's schema
            await c.configure_network(NetworkConfig(ipv6="not-an-address"))
        assert (e.value.code, e.value.message) == (
            Code.INVALID_ARGUMENT,
            "config.ipv6: an IPv6 address",
        )

    image_agent.run(scenario)
