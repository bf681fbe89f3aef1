"""The lean asyncio of feos.guest._lean: its package, the presets, asyncio's logger stand-in.

Each check runs in an interpreter of its own started as the image's launcher starts the agent
(python3 -S -E, the repo alone on sys.path, feos.guest.__main__ imported), beside one that
imports asyncio as usual: what the agent's asyncio offers is compared, name by name, with the
real one.
"""

from __future__ import annotations

import asyncio.log
import concurrent.futures
import json
import logging
import subprocess
import sys
from pathlib import Path

from feos.guest import _lean

REPO = Path(__file__).resolve().parents[2]

# What a module's asyncio offers: each name of __all__ with where its object comes from.
OFFERS = """
import asyncio, json
def where(obj):
    return [getattr(obj, "__module__", None), getattr(obj, "__qualname__", None) or repr(obj)]
def offers():
    return {"all": list(asyncio.__all__),
            "names": {n: where(getattr(asyncio, n)) for n in asyncio.__all__}}
"""

LEAN = """
import sys
sys.path.append(sys.argv[1])  # after the standard library, as the launcher puts it
import feos.guest.__main__
from feos.guest import _lean
"""


def run(program: str, lean: bool = True) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", (LEAN if lean else "") + program, str(REPO)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    result["stderr"] = out.stderr
    return result


def test_the_lean_package_offers_every_name_of_asyncio_from_the_same_place() -> None:
    lean = run(
        "pending = _lean.pending()" + OFFERS + 'print(json.dumps({"pending": pending, **offers()}))'
    )
    real = run(OFFERS + "print(json.dumps(offers()))", lean=False)
    assert lean["pending"] == list(_lean.LAZY)  # comparing loaded them: see below
    assert lean["all"] == real["all"]
    assert lean["names"] == real["names"]
    assert len(real["all"]) > 80  # type: ignore[arg-type]


def test_submodules_wait_until_used_and_import_as_usual() -> None:
    seen = run("""
import asyncio, json
waiting = [n for n in _lean.pending() if n.startswith("asyncio.")]
import asyncio.streams  # a submodule's import: it stays bound, and loads on use
from asyncio import queues
bound = [asyncio.streams is sys.modules["asyncio.streams"], queues is sys.modules["asyncio.queues"]]
still = "asyncio.streams" in _lean.pending()
q = asyncio.Queue()  # the package's __getattr__ loads asyncio.queues
async def main():
    p = await asyncio.create_subprocess_exec("echo", "hi", stdout=asyncio.subprocess.PIPE)
    out, _ = await p.communicate()
    async with asyncio.timeout(5):
        got = await asyncio.to_thread(lambda: 7)
    executor = await asyncio.get_running_loop().run_in_executor(None, lambda: 8)
    return [out.decode(), got, executor]
print(json.dumps({"waiting": waiting, "bound": bound, "still": still,
                  "queue": type(q).__module__, "ran": asyncio.run(main()),
                  "pending": _lean.pending()}))
""")
    assert seen["waiting"] == [n for n in _lean.LAZY if n.startswith("asyncio.")]
    assert seen["bound"] == [True, True] and seen["still"] is True
    assert seen["queue"] == "asyncio.queues"
    assert seen["ran"] == ["hi\n", 7, 8]
    loaded = {"asyncio.queues", "asyncio.subprocess", "asyncio.streams", "asyncio.timeouts",
              "asyncio.threads", "subprocess", "concurrent.futures", "logging"}  # fmt: skip
    pending = seen["pending"]
    assert isinstance(pending, list) and not loaded & set(pending)


def test_the_presets_are_the_values_of_the_real_modules() -> None:
    real = {"subprocess": subprocess, "logging": logging, "concurrent.futures": concurrent.futures}
    for name, values in _lean.PRESET.items():
        if name == "asyncio.log":
            assert isinstance(values["logger"], _lean._Logger)
            assert values["logger"]._name == asyncio.log.logger.name
            continue
        for attr, value in values.items():
            assert getattr(real[name], attr) == value, (name, attr)


def test_asyncios_logger_drops_debug_while_logging_waits_then_is_the_real_one() -> None:
    seen = run("""
import asyncio, json
logger = asyncio.base_events.logger
logger.debug("not shown")  # nothing configured logging: below WARNING it goes nowhere
logger.info("not shown either")
waited = "logging" in _lean.pending()
logger.warning("shown by logging's last resort")
import logging
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
logger.debug("shown once configured")
print(json.dumps({"waited": waited, "pending": _lean.pending(),
                  "level": logger.getEffectiveLevel(), "name": logger.name}))
""")
    assert seen["waited"] is True
    assert "logging" not in seen["pending"]  # type: ignore[operator]
    assert (seen["level"], seen["name"]) == (logging.DEBUG, "asyncio")
    assert "not shown" not in str(seen["stderr"])
    lines = str(seen["stderr"]).splitlines()
    assert lines == ["shown by logging's last resort", "asyncio shown once configured"]
