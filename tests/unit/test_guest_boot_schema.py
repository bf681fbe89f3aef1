"""The agent as the guest image lays it out: its own Cap'n Proto, no pycapnp, no site-packages.

The root is made of what the build ships (build.agent_sources: feos/__init__.py, feos/errors.py,
feos/guest/**, schema/*.capnp) and the launcher (packaging/guest/feos-guest, its directory
pointed at the test's root). The launcher's interpreter runs as in the guest, python3 -S -E: no
site-packages, so pycapnp cannot be imported there. Here: the agent's start in that root imports
nothing from outside it but the standard library, and the agent it starts serves the node's
client (pycapnp, in the test process).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _modpath import load

from feos.errors import Code, FeosError
from feos.guestlink import GuestClient, NetworkConfig

REPO = Path(__file__).resolve().parents[2]
IMAGE_DIR = "/usr/lib/feos-guest"  # the launcher's own idea of where the agent is


AgentProcess = load(
    "feos_test_guest_service", REPO / "tests/unit/test_guest_service.py"
).AgentProcess


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root laid out as the image's /usr/lib/feos-guest: what the build ships, the launcher."""
    build = load("feos_guest_build", REPO / "packaging/guest/build.py")
    root = tmp_path_factory.mktemp("feos-guest")
    for dst, src in build.agent_sources(REPO):
        (root / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, root / dst)
    launcher = (REPO / "packaging/guest/feos-guest").read_text()
    assert launcher.count(f'"{IMAGE_DIR}"') == 1, "the launcher names its directory once"
    (root / "feos-guest").write_text(launcher.replace(f'"{IMAGE_DIR}"', repr(str(root))))
    return root


# Run as the initramfs runs the launcher (python3 -S -E feos-guest), but for its argv: what
# follows the launcher's path is AgentProcess's `python -m feos.guest`, cut off here.
SHIM = """
import sys
launcher = sys.argv[1]
sys.argv = [launcher, *sys.argv[5:]]
with open(launcher) as f:
    code = compile(f.read(), launcher, "exec")
exec(code, {"__name__": "__main__", "__file__": launcher})
"""

PROBE = """
import sys, json
sys.path[0:1] = []
sys.path.append(sys.argv[1])
import feos.guest.__main__
files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
print(json.dumps({"files": files, "path": sys.path}))
"""


def test_the_agents_start_in_the_image_layout_needs_only_the_standard_library(
    image_root: Path,
) -> None:
    assert not (image_root / "site").exists() and not (image_root / "compiled").exists()
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", PROBE, str(image_root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    stdlib = [p for p in seen["path"] if p != str(image_root)]
    assert not [p for p in stdlib if "site-packages" in p]
    outside = {
        name: file
        for name, file in seen["files"].items()
        if file and not file.startswith((str(image_root), *stdlib))
    }
    assert outside == {}
    assert not [n for n in seen["files"] if n.split(".")[0] == "capnp"]
    agent = [n for n, f in seen["files"].items() if f and f.startswith(str(image_root))]
    assert {"feos.guest.__main__", "feos.guest._rpc", "feos.guest._wire"} <= set(agent)


@pytest.fixture(scope="module")
def image_agent(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The agent of image_root, started through its launcher under python3 -S -E."""
    prefix = [sys.executable, "-S", "-E", "-c", SHIM, str(image_root / "feos-guest")]
    a = AgentProcess(str(tmp_path_factory.mktemp("agent")), prefix=prefix)
    try:
        yield a
    finally:
        a.close()
        assert "Traceback" not in a.output(), a.output()


def test_the_agent_of_the_image_layout_serves_the_nodes_client(image_agent: Any) -> None:
    async def scenario(c: GuestClient) -> None:
        ping = await c.ping()
        assert ping.boot_id == c.boot_id
        attached = await asyncio.wait_for(c.attached, 5)
        assert attached.session == c.session
        with pytest.raises(FeosError) as e:  # a Status of common.capnp, as the agent writes it
            await c.configure_network(NetworkConfig(ipv6="not-an-address"))
        assert (e.value.code, e.value.message) == (
            Code.INVALID_ARGUMENT,
            "config.ipv6: an IPv6 address",
        )

    image_agent.run(scenario)
    assert "feos-guest: starting" in image_agent.output()
