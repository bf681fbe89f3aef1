"""The API server: Cap'n Proto interfaces served by trio services through the bridge.

Theory of operation: `serve(interface, impl, bridge)` builds a pycapnp Server for `interface`
whose every method does the same three things on the Cap'n Proto thread: turn the params into a
dict, run the service's trio method of the same name in snake_case (`getVolume` -> `get_volume`)
through the bridge (or on this thread itself, for a method marked `on_rpc_thread`), and write the
dict it returns into the results. A FeosError becomes the
results' status; any other exception is logged and answered INTERNAL; a method the service lacks
answers UNIMPLEMENTED. A service returns `Cap(interface, impl)` for a capability result (a
stream), which is served the same way.

Listeners are sockets feosd made itself (so a self-upgrade can hand them on); each connection is
its own two-party session, and garbage on one closes that one alone. The listeners are asyncio
servers: they are opened and closed on the Cap'n Proto thread (`listen`, `close_listeners`
through `bridge.call`), never touched from trio's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, cast, runtime_checkable

import attrs

from .._codec import camel, snake
from ..errors import Code, FeosError
from ._bridge import CapnpThread

log = logging.getLogger(__name__)


@attrs.frozen
class Cap:
    """A capability in a result: `impl` served as `interface`."""

    interface: Any
    impl: object


def status_dict(exc: FeosError) -> dict[str, Any]:
    status: dict[str, Any] = {"code": camel(exc.code.name.lower()), "message": exc.message}
    if exc.busy:
        status["vmBusy"] = {}
    return status


def _fill(results: Any, values: dict[str, Any], bridge: CapnpThread) -> None:
    for key, value in values.items():
        if isinstance(value, Cap):
            setattr(results, key, serve(value.interface, value.impl, bridge))
        elif value is not None:
            setattr(results, key, value)


def _method(name: str) -> Callable[..., Awaitable[None]]:
    py_name = snake(name)

    async def handler(self: Any, _context: Any, **_params: Any) -> None:
        results = _context.results
        target = getattr(self._impl, py_name, None)
        if target is None:
            results.status = status_dict(FeosError(Code.UNIMPLEMENTED, f"{name} is not built yet"))
            return
        params = _context.params.to_dict()
        try:
            if getattr(target, "_feos_rpc_thread", False):
                values = target(params)
                if asyncio.iscoroutine(values):
                    values = await values
            else:
                values = await self._bridge.to_trio(target, params)
        except FeosError as exc:
            results.status = status_dict(exc)
            return
        except Exception as exc:
            log.exception("%s failed", name)
            results.status = status_dict(FeosError(Code.INTERNAL, f"{name}: {exc}"))
            return
        if values:
            _fill(results, values, self._bridge)

    handler.__name__ = name
    return handler


def on_rpc_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a service's method as run on the Cap'n Proto thread itself, without the trip to trio.

    For plain reads of state that is replaced whole on a change (never mutated in place), which
    never block: the answer of a GetVolume is then a dict lookup away; for asyncio coroutines
    that live on that thread (the relays of a guest's streams); and for a change whose check and
    memory are cheap and whose only wait is its record (CreateVolume): it queues the record to
    its writer from here and awaits the outcome on this loop (feos.records), so that a call
    crosses threads twice (to the writer and back) rather than four times.
    """
    fn._feos_rpc_thread = True  # type: ignore[attr-defined]
    return fn


_classes: dict[int, type] = {}


def _server_class(interface: Any) -> type:
    cls = _classes.get(id(interface))
    if cls is None:
        namespace: dict[str, Any] = {n: _method(n) for n in interface.schema.method_names}

        def __init__(self: Any, impl: object, bridge: CapnpThread) -> None:
            interface.Server.__init__(self)
            self._impl = impl
            self._bridge = bridge

        namespace["__init__"] = __init__
        cls = type(
            f"{interface.schema.node.displayName.split(':')[-1]}Server",
            (interface.Server,),
            namespace,
        )
        _classes[id(interface)] = cls
    return cls


@runtime_checkable
class Released(Protocol):
    """A capability's service that owns what must end once no client holds it (a relay's tasks).

    `released` may run on any thread (a finalizer): it hands its work to the loop it belongs to.
    """

    def released(self) -> None: ...


def serve(interface: Any, impl: object, bridge: CapnpThread) -> Any:
    """A pycapnp server object of `interface` backed by the trio service `impl`.

    pycapnp drops its server object once the last client has let go of the capability (a
    release, or the connection's end): then a `Released` impl hears it."""
    server = _server_class(interface)(impl, bridge)
    if isinstance(impl, Released):
        weakref.finalize(server, impl.released)
    return server


async def _accept(bootstrap: Callable[[], Any], stream: Any) -> None:
    server = None
    try:
        import capnp

        server = capnp.TwoPartyServer(stream, bootstrap=bootstrap())
        await server.on_disconnect()
    except asyncio.CancelledError:
        return  # feosd stops: the connection ends with it
    except Exception as exc:  # a broken peer ends its own connection only
        log.debug("API connection ended: %s", exc)
    finally:
        if server is not None:
            server.close()


async def listen(sock: socket.socket, bootstrap: Callable[[], Any],
                 tls: ssl.SSLContext | None = None) -> asyncio.Server:
    """On the Cap'n Proto thread: serve every connection on the listening socket `sock`.

    With `tls`, a connection is served once its TLS handshake is done (asyncio's TLS): one that
    fails the handshake, or takes longer than HANDSHAKE_TIMEOUT_S, is closed unserved."""
    import capnp

    from ._tls import HANDSHAKE_TIMEOUT_S

    async def on_connect(stream: Any) -> None:
        await _accept(bootstrap, stream)

    if sock.family == socket.AF_UNIX:
        server = await capnp.AsyncIoStream.create_unix_server(on_connect, sock=sock)
    elif tls is not None:
        server = await capnp.AsyncIoStream.create_server(
            on_connect, sock=sock, ssl=tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
    else:
        server = await capnp.AsyncIoStream.create_server(on_connect, sock=sock)
    return cast(asyncio.Server, server)


async def close_listeners(servers: Iterable[asyncio.Server]) -> None:
    """On the Cap'n Proto thread (`bridge.call`): stop accepting; the connections end with it.

    An asyncio server belongs to its loop's thread: closed from trio's, it would change the
    loop's selector under the loop's feet."""
    _need_capnp_thread("the API's listeners are closed")
    for server in servers:
        server.close()


def _need_capnp_thread(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(f"{what} on the Cap'n Proto thread, through the bridge") from None
