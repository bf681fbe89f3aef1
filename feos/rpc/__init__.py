"""Cap'n Proto RPC for feosd: the thread bridge, the API server, and the client feosctl uses.

The bridge's names load on first use (PEP 562): feosctl's client runs on asyncio and imports
feos.rpc._client only, and the bridge would bring trio into every feosctl start (60 ms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._bridge import CapnpThread as CapnpThread
    from ._bridge import capnp_thread as capnp_thread

_LAZY = {"CapnpThread", "capnp_thread"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _bridge

        return getattr(_bridge, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
