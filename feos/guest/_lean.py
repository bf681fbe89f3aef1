"""The agent's imports, made lean for its start under TCG (bench/guest_boot.py --imports).

Under QEMU's TCG every import costs about twenty times what it costs on the host, and the time
from the guest's start to its first answered Ping is mostly the agent's imports. `imports()`
wraps them (feos.guest.__main__ only: the node's side and the tests import as usual):
- `ssl` cannot be imported while it runs: asyncio imports ssl only to offer TLS transports,
  which the agent never uses (asyncio binds ssl = None then). Once the block ends, `import ssl`
  works again, so the registry client's http.client (imported on the first pull) has HTTPS;
- modules the agent's start never uses, imported at the top of modules it needs, load lazily
  (a _Lazy module, below): on the first use of any of their attributes. A few constants that
  the start's modules read of them at their top (default arguments, say) are answered without
  their code (PRESET);
- the asyncio package imports only the submodules the start uses (_lean_asyncio): the others
  (streams, subprocess, queues, ...) load on the first use of a name of theirs, through the
  package's __getattr__ (PEP 562), and `import asyncio.streams` works as before;
- extension modules are loaded with RTLD_LAZY: their calls into other libraries are bound on
  first use, not all at once as Python's RTLD_NOW does. Of Debian's python3.11 only _asyncio
  and _contextvars are loaded so on the start (the rest of what it imports is built in), which
  makes it worth little now, but it is general and harmless: the standard library's extensions
  call only libpython and libc, whose symbols are there, so nothing but the moment of binding
  changes (a missing symbol would fail at its first call, not at the import);
- the cyclic garbage collector waits: imports make no garbage cycles worth a pass, and the
  objects they leave are frozen (gc.freeze) so that later passes skip them.

Not importlib.util.LazyLoader: in Python 3.11 every later `import json` loads its module (the
import system reads the module's __spec__, and any attribute loads it), and it has no lock. A
_Lazy module answers __spec__ and __path__ without loading, and loads once, under its lock,
whatever thread touches it first.
"""

from __future__ import annotations

# The import system's own path finder and module maker, loaded with the interpreter: importlib's
# package (importlib.machinery, importlib.util) would be one more import of the start.
import _frozen_importlib  # type: ignore[import-not-found]
import _frozen_importlib_external  # type: ignore[import-not-found]
import _thread
import gc
import os
import sys
import types
from contextlib import contextmanager

PathFinder = _frozen_importlib_external.PathFinder

TYPE_CHECKING = False  # mypy takes it as true; typing itself costs the start time
if TYPE_CHECKING:
    from collections.abc import Iterator
    from importlib.machinery import ModuleSpec
    from typing import Any

# What the start does not use, though modules it needs import it at their top (measured in the
# guest with bench/guest_boot.py --imports). A parent comes before its submodules.
LAZY = (
    "json",  # _containers, _images: records, once there are containers or images
    "shutil",  # _containers (it pulls in bz2 and lzma): removing bundles
    "hashlib",  # _images: digests, once an image is pulled (it loads libcrypto)
    "tokenize",  # linecache (traceback's): source lines of a traceback
    "textwrap",  # traceback: notes of an exception
    "inspect",  # asyncio: iscoroutinefunction, in run_in_executor (not add_signal_handler)
    "linecache",  # traceback (which _asyncio needs at once): source lines
    "locale",  # subprocess: text mode's encoding
    "subprocess",  # asyncio: its constants only, until a process is started
    "logging",  # asyncio, concurrent.futures: their loggers, for errors and debug mode
    "concurrent.futures",  # asyncio: run_in_executor, wrap_future (it pulls in logging)
    "asyncio.log",  # asyncio's logger (PRESET: a stand-in that imports logging on first use)
    "asyncio.staggered",  # happy eyeballs in create_connection (it imports typing)
    "asyncio.sslproto",  # TLS transports: start_tls, create_connection(ssl=...)
    "asyncio.queues",  # the rest: what asyncio's package imports but the start never uses
    "asyncio.streams",
    "asyncio.subprocess",
    "asyncio.taskgroups",
    "asyncio.timeouts",  # it imports typing
    "asyncio.threads",
)
BLOCKED = ("ssl",)


class _Logger:
    """logging.getLogger(name), once used: logging is imported on the first use of an attribute.

    But for debug and info while logging waits (a _Lazy module): nothing can have configured it
    then, and an unconfigured logger drops what is below WARNING. asyncio's loop says debug
    ("Using selector") each time one is made.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr in ("debug", "info") and type(sys.modules.get("logging")) is _Lazy:
            return _dropped
        import logging

        return getattr(logging.getLogger(self._name), attr)

    def __repr__(self) -> str:
        return f"<logger {self._name} (logging imported on first use)>"


def _dropped(*args: object, **kwargs: object) -> None:
    """A record below WARNING, to a logging nothing has configured."""


# What the start's modules read of lazy modules at their top, with the values the modules' own
# code sets (tests/unit/test_guest_lean.py compares them with the real modules').
PRESET: dict[str, dict[str, object]] = {
    "subprocess": {"PIPE": -1, "STDOUT": -2, "DEVNULL": -3},  # asyncio's default arguments
    "logging": {"DEBUG": 10},  # asyncio.futures: STACK_DEBUG
    "concurrent.futures": {  # asyncio.tasks: its own names for them
        "FIRST_COMPLETED": "FIRST_COMPLETED",
        "FIRST_EXCEPTION": "FIRST_EXCEPTION",
        "ALL_COMPLETED": "ALL_COMPLETED",
    },
    "asyncio.log": {"logger": _Logger("asyncio")},  # `from .log import logger`, 8 modules
}

# The asyncio package (Python 3.11): its submodules in the order its __init__ star-imports them,
# and, of those loaded on first use, the names their __all__ gives the package.
ASYNCIO_EAGER = ("base_events", "coroutines", "events", "exceptions", "futures", "locks",
                 "protocols", "runners", "tasks", "transports", "unix_events")  # fmt: skip
ASYNCIO_NAMES = {
    "queues": ("Queue", "PriorityQueue", "LifoQueue", "QueueFull", "QueueEmpty"),
    "streams": ("StreamReader", "StreamWriter", "StreamReaderProtocol", "open_connection",
                "start_server", "open_unix_connection", "start_unix_server"),
    "subprocess": ("create_subprocess_exec", "create_subprocess_shell"),
    "taskgroups": ("TaskGroup",),
    "timeouts": ("Timeout", "timeout", "timeout_at"),
    "threads": ("to_thread",),
}  # fmt: skip
_ASYNCIO_ORDER = (*ASYNCIO_EAGER[:8], "queues", "streams", "subprocess", "tasks", "taskgroups",
                  "timeouts", "threads", "transports", "unix_events")  # fmt: skip
# and the order of its __all__, which leaves taskgroups out (Python 3.11's, as it is)
_ASYNCIO_ALL = (*ASYNCIO_EAGER[:8], "queues", "streams", "subprocess", "tasks", "threads",
                "timeouts", "transports", "unix_events")  # fmt: skip


class _Lazy(types.ModuleType):
    """A module whose code runs on the first use of an attribute the import system does not read.

    The import system reads __spec__ (`import name`) and __path__ (`from name import x`); the
    PRESET names are answered as they are.
    """

    def __getattribute__(self, attr: str) -> Any:
        spec: ModuleSpec = object.__getattribute__(self, "__spec__")
        if attr in ("__spec__", "__path__"):
            return object.__getattribute__(self, attr)
        state = spec.loader_state
        if attr in state["preset"] and type(self) is _Lazy:
            return state["preset"][attr]
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
        return types.ModuleType.__getattribute__(self, attr)  # with the module's __getattr__


@contextmanager
def imports() -> Iterator[None]:
    """Within: ssl blocked, the LAZY modules lazy, a lean asyncio, lazy binding, no GC."""
    gc.disable()
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY)
    blocked = [name for name in BLOCKED if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        lean = _lean_asyncio()
        for name in LAZY:
            if lean or not name.startswith("asyncio."):
                _make_lazy(name)
        if lean:
            _run_asyncio_init()
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
        sys.setdlopenflags(flags)
        gc.freeze()
        gc.enable()


def _make_lazy(name: str) -> None:
    """sys.modules[name]: a _Lazy module, bound in its parent package as an import would."""
    parent, _, child = name.rpartition(".")
    if name in sys.modules:
        return
    if parent:
        package = sys.modules.get(parent) or __import__(parent, fromlist=["_"])
        spec = PathFinder.find_spec(name, package.__path__)
    else:
        spec = PathFinder.find_spec(name)
    if spec is None or spec.loader is None:
        return
    spec.loader_state = {"lock": _thread.RLock(), "running": False,
                         "preset": PRESET.get(name, {})}  # fmt: skip
    module = _module_from_spec(spec)  # its __spec__, __loader__, __file__; no code run yet
    module.__class__ = _Lazy
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], child, module)


def _module_from_spec(spec: ModuleSpec) -> types.ModuleType:
    return _frozen_importlib.module_from_spec(spec)  # type: ignore[no-any-return]


def _lean_asyncio() -> bool:
    """sys.modules["asyncio"]: the real package (its __path__), its __init__ not run. False if
    it cannot be: imported already, or not the Python whose asyncio ASYNCIO_NAMES describes."""
    if "asyncio" in sys.modules or sys.version_info[:2] != (3, 11) or sys.platform == "win32":
        return False
    spec = PathFinder.find_spec("asyncio")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = _module_from_spec(spec)
    by_name = {n: sub for sub, names in ASYNCIO_NAMES.items() for n in names}

    def __getattr__(name: str) -> object:  # PEP 562: only for names not bound yet
        sub = by_name.get(name)
        if sub is None:
            raise AttributeError(f"module 'asyncio' has no attribute {name!r}")
        value = getattr(sys.modules[f"asyncio.{sub}"], name)  # the _Lazy submodule loads
        setattr(package, name, value)
        return value

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["asyncio"] = package
    return True


def _run_asyncio_init() -> None:
    """What asyncio/__init__.py does, but for the star-imports of the lazy submodules."""
    package = sys.modules["asyncio"]
    exported: dict[str, tuple[str, ...]] = dict(ASYNCIO_NAMES)
    for sub in _ASYNCIO_ORDER:
        if sub not in ASYNCIO_NAMES:
            module = __import__(f"asyncio.{sub}", fromlist=["_"])
            exported[sub] = getattr(module, "__all__")  # noqa: B009
            for name in exported[sub]:
                setattr(package, name, getattr(module, name))
    names = tuple(n for sub in _ASYNCIO_ALL for n in exported[sub])
    vars(package).update(sys=sys, __all__=names)  # as asyncio/__init__.py has them


def pending() -> list[str]:
    """The lazy modules not loaded yet (tests, and a look at what the start used)."""
    return [n for n in LAZY if type(sys.modules.get(n)) is _Lazy]
