"""Cap'n Proto RPC for feosd: the thread bridge, the API server, and the client feosctl uses.

The client's names load with the package; the bridge's and the server's on first use (PEP 562):
feosctl's client runs on asyncio, and the bridge would bring trio into every feosctl start
(60 ms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._client import SERVICES as SERVICES
from ._client import Client as Client
from ._client import is_socket_path as is_socket_path
from ._client import raise_for_status as raise_for_status
from ._client import translate as translate

if TYPE_CHECKING:
    from ._bridge import CapnpThread as CapnpThread
    from ._bridge import capnp_thread as capnp_thread
    from ._server import Cap as Cap
    from ._server import Released as Released
    from ._server import close_listeners as close_listeners
    from ._server import listen as listen
    from ._server import on_rpc_thread as on_rpc_thread
    from ._server import serve as serve
    from ._server import status_dict as status_dict
    from ._tls import ClientTls as ClientTls
    from ._tls import ServerContexts as ServerContexts
    from ._tls import ServerTls as ServerTls
    from ._tls import is_loopback as is_loopback
    from ._tls import own_certificate as own_certificate
    from ._tls import pin_of as pin_of

_LAZY = {
    "CapnpThread": "_bridge", "capnp_thread": "_bridge",
    "Cap": "_server", "Released": "_server", "close_listeners": "_server",
    "listen": "_server", "on_rpc_thread": "_server", "serve": "_server",
    "status_dict": "_server",
    "ClientTls": "_tls", "ServerContexts": "_tls", "ServerTls": "_tls", "is_loopback": "_tls",
    "own_certificate": "_tls", "pin_of": "_tls",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)
