"""The client of feosd's API, on asyncio: feosctl runs it directly, trio code through the bridge.

`Client.call(service, method, **params)` sends one call and returns its results after checking
their status: a status other than ok is raised as the FeosError it stands for, busy marker
included.
"""

from __future__ import annotations

import socket
from typing import Any

import capnp

from .. import _schema
from .._names import snake
from .._sockpath import reachable
from ..errors import Code, FeosError

SERVICES = ("pods", "volumes", "securityGroups", "names", "traffic", "host", "mesh",
            "templates")


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

    def __init__(self, client: Any) -> None:
        self._client = client
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
    async def connect_tcp(cls, host: str, port: int) -> Client:
        try:
            stream = await capnp.AsyncIoStream.create_connection(host=host, port=port)
        except OSError as exc:
            raise FeosError(
                Code.UNAVAILABLE, f"cannot reach feosd at {host}:{port}: {exc}"
            ) from exc
        return cls(capnp.TwoPartyClient(stream))

    @classmethod
    async def connect(cls, address: str) -> Client:
        """A socket path, or HOST:PORT / [V6]:PORT for TCP."""
        if address.startswith("/") or address.startswith(".") or ":" not in address:
            return await cls.connect_unix(address)
        host, _, port = address.rpartition(":")
        return await cls.connect_tcp(host.strip("[]"), int(port))

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
            raise FeosError(
                Code.UNAVAILABLE, f"feosd did not answer {method}: {exc.description}"
            ) from exc
        return raise_for_status(results)

    def close(self) -> None:
        self._client.close()


async def _sock_connect(sock: socket.socket, path: str) -> None:
    import asyncio

    with reachable(path) as short:
        await asyncio.get_running_loop().sock_connect(sock, short)
