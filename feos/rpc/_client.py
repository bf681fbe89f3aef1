"""The client of feosd's API, on asyncio: feosctl runs it directly, trio code through the bridge.

`Client.call(service, method, **params)` sends one call and returns its results after checking
their status: a status other than ok is raised as the FeosError it stands for, busy marker
included.
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Any

import capnp

from .. import _schema
from .._names import snake
from .._sockpath import reachable
from ..errors import Code, FeosError

if TYPE_CHECKING:
    from ._tls import ClientContext, ClientTls

SERVICES = ("pods", "volumes", "securityGroups", "names", "traffic", "host", "mesh",
            "templates")


def is_socket_path(address: str) -> bool:
    """Whether an API address is a Unix socket's path rather than HOST:PORT."""
    return address.startswith("/") or address.startswith(".") or ":" not in address


def raise_for_status(results: Any) -> Any:
    """The results, or the FeosError their status stands for."""
    status = results.status
    code_name = snake(str(status.code)).upper()
    if code_name == "OK":
        return results
    code = Code.__members__.get(code_name, Code.UNKNOWN)
    raise FeosError(code, status.message, busy=status._has("vmBusy"))


def translate(exc: Exception, where: str) -> FeosError:
    """A transport failure as the status a caller can act on."""
    if isinstance(exc, FeosError):
        return exc
    return FeosError(Code.UNAVAILABLE, f"{where}: {exc}")


class Client:
    """One connection to feosd's API."""

    def __init__(self, client: Any, *, where: str = "", tls: ClientContext | None = None) -> None:
        self._client = client
        self._where = where
        self._tls = tls  # on TCP with TLS
        self._feos = client.bootstrap().cast_as(_schema.api().Feos)
        self._services: dict[str, Any] = {}

    @classmethod
    async def connect_unix(cls, path: str) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await _sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise FeosError(
                Code.UNAVAILABLE, f"cannot reach feosd at {path}: {exc.strerror}"
            ) from exc
        stream = await capnp.AsyncIoStream.create_connection(sock=sock)
        return cls(capnp.TwoPartyClient(stream))

    @classmethod
    async def connect_tcp(cls, host: str, port: int, tls: ClientTls | None = None) -> Client:
        """A TCP connection, over TLS 1.3 with `tls` (feosd's --tcp-client-ca), else plain."""
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ctx = tls.context() if tls is not None else None
        extra: dict[str, Any] = {}
        if tls is not None:
            from ._tls import HANDSHAKE_TIMEOUT_S

            extra = {"ssl": ctx, "server_hostname": tls.server_name or host,
                     "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        try:
            stream = await capnp.AsyncIoStream.create_connection(host=host, port=port, **extra)
        except ssl.SSLError as exc:
            from ._tls import refusal

            raise FeosError(Code.UNAVAILABLE, f"feosd at {where} failed the TLS handshake: "
                            f"{refusal(exc)}") from exc
        except OSError as exc:
            raise FeosError(Code.UNAVAILABLE, f"cannot reach feosd at {where}: {exc}") from exc
        return cls(capnp.TwoPartyClient(stream), where=where, tls=ctx)

    @classmethod
    async def connect(cls, address: str, tls: ClientTls | None = None) -> Client:
        """A socket path, or HOST:PORT / [V6]:PORT for TCP (over TLS with `tls`)."""
        if is_socket_path(address):
            return await cls.connect_unix(address)
        host, _, port = address.rpartition(":")
        return await cls.connect_tcp(host.strip("[]"), int(port), tls)

    def service(self, name: str) -> Any:
        if name not in self._services:
            if name not in SERVICES:
                raise ValueError(f"no service {name!r}")
            self._services[name] = getattr(self._feos, name)().service
        return self._services[name]

    async def call(self, service: str, method: str, **params: Any) -> Any:
        """Call service.method(params); the results, or the FeosError of their status."""
        try:
            results = await getattr(self.service(service), method)(**params)
        except capnp.KjException as exc:
            raise self._lost(method, exc) from exc
        return raise_for_status(results)

    def close(self) -> None:
        self._client.close()

    def _lost(self, method: str, exc: capnp.KjException) -> FeosError:
        if self._tls is not None and self._tls.refused():
            return FeosError(Code.UNAUTHENTICATED, f"feosd at {self._where} refused this client "
                             "in the TLS handshake: no certificate, or one its CAs did not issue, "
                             "an expired one or a node's (feosd's log says which)")
        hint = ""
        if self._where and self._tls is None and exc.type == "DISCONNECTED":
            hint = " (a feosd that serves TLS on TCP drops a client without it: --tls-cert)"
        return FeosError(Code.UNAVAILABLE,
                         f"feosd did not answer {method}: {exc.description}{hint}")


async def _sock_connect(sock: socket.socket, path: str) -> None:
    import asyncio

    with reachable(path) as short:
        await asyncio.get_running_loop().sock_connect(sock, short)
