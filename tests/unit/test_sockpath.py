"""Unix sockets below a directory too deep for sun_path (a --state-dir or --run-dir under
pytest's tmp_path, say): feosd binds and connects them through a descriptor of the directory."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
import trio

from feos._sockpath import SUN_PATH_MAX, bind_unix, reachable
from feos.rpc._client import _sock_connect
from feos.vmm._qmp import connect_qmp


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    d = tmp_path / ("d" * 60) / ("e" * 60) / ("f" * 40)
    d.mkdir(parents=True)
    assert len(str(d / "guest.sock")) > 150
    return d


def test_a_short_path_is_itself_and_a_long_one_goes_through_its_directory(deep: Path) -> None:
    with reachable("/run/feos/api.sock") as short:
        assert short == "/run/feos/api.sock"
    with reachable(deep / "qmp.sock") as short:
        assert short.startswith("/proc/self/fd/") and short.endswith("/qmp.sock")
        assert len(short) <= SUN_PATH_MAX
        assert Path(short).parent.resolve() == deep.resolve()


def test_the_kernel_refuses_the_long_path_itself(deep: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError, match="too long"):
        s.bind(str(deep / "api.sock"))


async def test_api_socket_in_a_deep_run_dir_binds_and_takes_a_connection(deep: Path) -> None:
    listener = bind_unix(deep / "api.sock")
    try:
        assert (deep / "api.sock").exists()  # at its own path, for feosctl --socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.setblocking(False)

            async def connect() -> None:
                await _sock_connect(client, str(deep / "api.sock"))

            await trio.to_thread.run_sync(asyncio.run, connect())
            conn, _ = listener.accept()
            conn.close()
    finally:
        listener.close()


async def test_qmp_in_a_deep_directory_connects(deep: Path) -> None:
    server = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with reachable(deep / "qmp.sock") as short:
        await server.bind(short)
    server.listen(1)

    async def qemu() -> None:
        conn, _ = await server.accept()
        with conn:
            await conn.send(json.dumps({"QMP": {"version": {}, "capabilities": []}}).encode()
                            + b"\n")
            request = json.loads(await conn.recv(4096))
            await conn.send(json.dumps({"return": {}, "id": request.get("id")}).encode()
                            + b"\n")
            await conn.recv(1)  # until the client closes

    async with trio.open_nursery() as nursery:
        nursery.start_soon(qemu)
        qmp = await connect_qmp(str(deep / "qmp.sock"), within=10)
        qmp.close()
    server.close()
