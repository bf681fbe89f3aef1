"""diskd's clients: `DiskdConnection` on asyncio (diskctl), `Diskd` for trio code (feosd).

`DiskdConnection.call(method, **params)` sends one call of schema/disk.capnp's DiskService and
returns its results as a plain dict (camelCase, as the schema names them) once their status is
ok; any other status is raised as its FeosError. `Diskd` holds one connection on feosd's Cap'n
Proto thread (through the bridge), made on first use and made again after diskd restarted; where
feosd needs a disk it waits for diskd to answer, up to `wait_s`, and then fails UNAVAILABLE
naming diskd.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import capnp
import trio

from .. import _schema
from .._sockpath import reachable
from ..errors import Code, FeosError
from ..rpc import raise_for_status

WAIT_S = 120.0  # the spec's two minutes
RETRY_S = 0.5


class DiskdConnection:
    """One connection to diskd's socket, on asyncio (the Cap'n Proto thread, or diskctl's)."""

    def __init__(self, client: Any, path: str) -> None:
        self._client = client
        self._path = path
        self._service = client.bootstrap().cast_as(_schema.disk().DiskService)

    @classmethod
    async def connect(cls, path: str) -> DiskdConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            with reachable(path) as short:
                await asyncio.get_running_loop().sock_connect(sock, short)
        except OSError as exc:
            sock.close()
            raise FeosError(Code.UNAVAILABLE,
                            f"diskd does not answer at {path}: {exc.strerror}") from exc
        stream = await capnp.AsyncIoStream.create_connection(sock=sock)
        return cls(capnp.TwoPartyClient(stream), path)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        try:
            results = await getattr(self._service, method)(**params)
        except capnp.KjException as exc:
            raise FeosError(Code.UNAVAILABLE,
                            f"diskd did not answer {method}: {exc.description}") from exc
        raise_for_status(results)
        answer: dict[str, Any] = results.to_dict()
        answer.pop("status", None)
        return answer

    def close(self) -> None:
        self._client.close()


async def _call(connection: DiskdConnection, method: str, params: dict[str, Any]
                ) -> dict[str, Any]:
    return await connection.call(method, **params)


async def _close(connection: DiskdConnection) -> None:
    connection.close()


class Diskd:
    """feosd's side: calls to diskd from trio through the bridge (feos.rpc.CapnpThread)."""

    def __init__(self, path: Path, bridge: Any, *, wait_s: float = WAIT_S) -> None:
        self.path = path
        self._bridge = bridge
        self._wait_s = wait_s
        self._connection: DiskdConnection | None = None
        self._lock = trio.Lock()

    async def _connected(self, wait: bool) -> DiskdConnection:
        async with self._lock:
            if self._connection is not None:
                return self._connection
            deadline = trio.current_time() + (self._wait_s if wait else 0.0)
            while True:
                try:
                    self._connection = await self._bridge.call(DiskdConnection.connect,
                                                               str(self.path))
                    return self._connection
                except FeosError as exc:
                    if trio.current_time() + RETRY_S > deadline:
                        waited = f" within {self._wait_s:g}s" if wait else ""
                        raise FeosError(Code.UNAVAILABLE,
                                        f"diskd did not answer{waited}: {exc.message}") from None
                await trio.sleep(RETRY_S)

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]:
        """One call; a connection that broke (diskd restarted) is made again once."""
        for attempt in (1, 2):
            connection = await self._connected(wait)
            try:
                answer: dict[str, Any] = await self._bridge.call(_call, connection, method,
                                                                 params)
                return answer
            except FeosError as exc:
                if not exc.message.startswith("diskd did not answer") or attempt == 2:
                    raise
                await self._drop(connection)
        raise AssertionError("unreachable")

    async def _drop(self, connection: DiskdConnection) -> None:
        async with self._lock:
            if self._connection is connection:
                self._connection = None
        await self._bridge.call(_close, connection)

    async def answers(self) -> bool:
        """diskd answers now (no wait): feosd's start says whether it found one."""
        try:
            await self.call("info", wait=False)
        except FeosError:
            return False
        return True

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await self._bridge.call(_close, connection)
