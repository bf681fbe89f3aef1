"""The console's server: hypercorn's trio worker serving ConsoleApp on feosd's own trio loop.

`serve_console` binds ADDRESS:PORT, makes (or reads) the access token when the address is not
loopback, and reports readiness to its nursery with the address it listens on. It runs until
cancelled (feosd's stop), when hypercorn closes its connections.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ._api import Api
from ._app import ConsoleApp
from ._security import TOKEN_FILE, Guard, is_loopback, load_or_make_token

log = logging.getLogger("feosd.web")


def parse_web_address(text: str) -> tuple[str, int]:
    """ADDRESS:PORT, as --web takes it ([::1]:8080, 127.0.0.1:8080); ValueError if not."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not ADDRESS:PORT (such as 127.0.0.1:8080 or [::1]:8080)")
    return host.strip("[]"), int(port)


def make_guard(state_dir: Path, host: str) -> Guard:
    csrf = secrets.token_urlsafe(24)
    if is_loopback(host):
        return Guard(csrf)
    token, made = load_or_make_token(state_dir)
    if made:
        log.warning("the web console's access token (printed once, kept in %s): %s",
                    state_dir / TOKEN_FILE, token)
    else:
        log.info("the web console's access token is in %s", state_dir / TOKEN_FILE)
    return Guard(csrf, token)


def _config(host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("feosd.web.http")  # feosd's own log, not a second one
    config.keep_alive_timeout = 75
    return config


async def serve_console(api: Api, state_dir: Path, address: tuple[str, int], *,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    host, port = address
    app = ConsoleApp(api, make_guard(state_dir, host))
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(_serve, app, _config(host, port))
        log.info("serving the web console on %s", ", ".join(binds))
        task_status.started(binds)


async def _serve(app: ConsoleApp, config: Config, *,
                 task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    await serve(app, config, task_status=task_status)  # type: ignore[arg-type]
