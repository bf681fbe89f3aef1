"""The agent's imports, made lean for its start under TCG (bench/guest_boot.py --imports).

Under QEMU's TCG every import costs about twenty times what it costs on the host, and the time
from the guest's start to its first answered Ping is mostly the agent's imports. `imports()`
wraps them (feos.guest.__main__ only: the node's side and the tests import as usual):
- `ssl` cannot be imported while it runs: asyncio imports ssl only to offer TLS transports,
  which the agent never uses (asyncio binds ssl = None then). Once the block ends, `import ssl`
  works again, so the registry client's http.client (imported on the first pull) has HTTPS;
- modules the agent's start never uses, imported at the top of modules it needs, load lazily
  (a _Lazy module, below): on the first use of any of their attributes;
- extension modules (pycapnp's 3 MB of C++) are loaded with RTLD_LAZY: their calls into other
  libraries are bound on first use, not all 2,600 at once as Python's RTLD_NOW does;
- the cyclic garbage collector waits: imports make no garbage cycles worth a pass, and the
  objects they leave are frozen (gc.freeze) so that later passes skip them.

Not importlib.util.LazyLoader: in Python 3.11 every later `import json` loads its module (the
import system reads the module's __spec__, and any attribute loads it), and it has no lock. A
_Lazy module answers __spec__ without loading, and loads once, under its lock, whatever thread
touches it first.
"""

from __future__ import annotations

import _thread
import gc
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from typing import Any

# What the start does not use, though modules it needs import it at their top (measured in the
# guest with bench/guest_boot.py --imports).
LAZY = (
    "json",  # _containers, _images: records, once there are containers or images
    "shutil",  # _containers (it pulls in bz2 and lzma): removing bundles
    "hashlib",  # _images: digests, once an image is pulled (it loads libcrypto)
    "tokenize",  # linecache (traceback's): source lines of a traceback
    "textwrap",  # traceback: notes of an exception
    "inspect",  # asyncio, capnp: iscoroutinefunction, in run_in_executor (not add_signal_handler)
    "linecache",  # traceback (which _asyncio needs at once): source lines
    "locale",  # subprocess: text mode's encoding
    "random",  # capnp: nothing at its start
    "base64",  # capnp: to_dict and from_dict of Data
)
BLOCKED = ("ssl",)


class _Lazy(types.ModuleType):
    """A module whose code runs on the first use of an attribute other than __spec__."""

    def __getattribute__(self, attr: str) -> Any:
        spec: ModuleSpec = object.__getattribute__(self, "__spec__")
        if attr == "__spec__":  # what `import name` reads of a module in sys.modules
            return spec
        state = spec.loader_state
        with state["lock"]:  # other threads wait here while one runs the module's code
            if type(self) is _Lazy and not state["running"]:
                state["running"] = True  # its own code's uses of itself go past
                try:
                    spec.loader.exec_module(self)  # type: ignore[union-attr]
                except BaseException:
                    sys.modules.pop(spec.name, None)
                    raise
                finally:
                    state["running"] = False
                self.__class__ = types.ModuleType  # type: ignore[assignment]
        return object.__getattribute__(self, attr)


@contextmanager
def imports() -> Iterator[None]:
    """Within: ssl blocked, the LAZY modules lazy, lazy binding, no garbage collection."""
    gc.disable()
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY)
    blocked = [name for name in BLOCKED if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        for name in LAZY:
            _make_lazy(name)
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
        sys.setdlopenflags(flags)
        gc.freeze()
        gc.enable()


def _make_lazy(name: str) -> None:
    from importlib.util import find_spec, module_from_spec

    if name in sys.modules or (spec := find_spec(name)) is None or spec.loader is None:
        return
    spec.loader_state = {"lock": _thread.RLock(), "running": False}
    module = module_from_spec(spec)  # its __spec__, __loader__, __file__; no code run yet
    module.__class__ = _Lazy
    sys.modules[name] = module


def pending() -> list[str]:
    """The lazy modules not loaded yet (tests, and a look at what the start used)."""
    return [n for n in LAZY if type(sys.modules.get(n)) is _Lazy]
