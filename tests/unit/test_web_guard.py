"""The web console's guard at the ASGI level: the real ConsoleApp over a real VolumeService.

A change needs the page's origin and its CSRF token; a console bound off loopback needs its
access token for everything; one on loopback answers only to a loopback Host. The volumes are
the service here because they need no microVM; the checks are the same for every call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from feos.pods import VolumeService
from feos.web import Api, ConsoleApp, Guard
from feos.web._security import load_or_make_token

VOLUME = "3f0c2a51-6b7e-4d1c-9a8f-2e5d4c3b2a10"
HOST = "127.0.0.1:8080"


async def request(app: ConsoleApp, method: str, path: str, body: dict[str, Any] | None = None,
                  **headers: str) -> tuple[int, bytes]:
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": raw}
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": json.dumps(body or {}).encode()}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def volumes(tmp_path: Path) -> VolumeService:
    service = VolumeService(tmp_path)
    service.load()
    return service


def create(size: int = 64 << 20) -> dict[str, Any]:
    return {"id": VOLUME, "sizeBytes": size}


async def test_a_change_needs_the_origin_and_the_csrf_token(volumes: VolumeService) -> None:
    app = ConsoleApp(Api({"volumes": volumes}), Guard("c" * 32))
    path = "/api/volumes/createVolume"
    assert (await request(app, "POST", path, create(), host=HOST))[0] == 403
    assert (await request(app, "POST", path, create(), host=HOST, x_csrf_token="c" * 32))[0] == 403
    other = {"host": HOST, "origin": "http://evil.example", "x_csrf_token": "c" * 32}
    assert (await request(app, "POST", path, create(), **other))[0] == 403
    forged = {"host": HOST, "origin": f"http://{HOST}", "x_csrf_token": "x" * 32}
    assert (await request(app, "POST", path, create(), **forged))[0] == 403
    assert volumes.list_volumes({}) == {"volumes": []}
    good = {"host": HOST, "origin": f"http://{HOST}", "x_csrf_token": "c" * 32}
    status, body = await request(app, "POST", path, create(), **good)
    assert status == 200 and json.loads(body)["volume"]["id"] == VOLUME


async def test_the_apis_error_comes_back_as_its_status(volumes: VolumeService) -> None:
    app = ConsoleApp(Api({"volumes": volumes}), Guard("c" * 32))
    good = {"host": HOST, "sec_fetch_site": "same-origin", "x_csrf_token": "c" * 32}
    status, body = await request(app, "POST", "/api/volumes/createVolume", create(5), **good)
    assert status == 200
    answer = json.loads(body)["status"]
    assert answer["code"] == "invalidArgument" and answer["message"].startswith("sizeBytes")
    status, body = await request(app, "POST", "/api/host/upgradeFeosBinary", {}, **good)
    assert json.loads(body)["status"]["code"] == "notFound"


async def test_on_loopback_it_answers_only_to_a_loopback_host(volumes: VolumeService) -> None:
    app = ConsoleApp(Api({"volumes": volumes}), Guard("c" * 32))
    assert (await request(app, "GET", "/", host="rebound.example:8080"))[0] == 421
    status, page = await request(app, "GET", "/", host="[::1]:8080")
    assert status == 200 and b'content="' + b"c" * 32 in page


async def test_off_loopback_everything_needs_the_access_token(volumes: VolumeService,
                                                              tmp_path: Path) -> None:
    token, made = load_or_make_token(tmp_path)
    assert made and os.stat(tmp_path / "web-token").st_mode & 0o777 == 0o600
    assert load_or_make_token(tmp_path) == (token, False)
    app = ConsoleApp(Api({"volumes": volumes}), Guard("c" * 32, token))
    host = "192.0.2.1:8080"
    assert (await request(app, "GET", "/", host=host))[0] == 401
    assert (await request(app, "GET", "/", host=host, cookie="feos_console=wrong"))[0] == 401
    assert (await request(app, "GET", "/", host=host, cookie=f"feos_console={token}"))[0] == 200
    change = {"host": host, "origin": f"http://{host}", "x_csrf_token": "c" * 32}
    assert (await request(app, "POST", "/api/volumes/createVolume", create(), **change))[0] == 401
    status, _ = await request(app, "POST", "/api/volumes/createVolume", create(),
                              authorization=f"Bearer {token}", **change)
    assert status == 200
