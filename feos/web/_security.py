"""Who may use the console: the access token, the origin check and the CSRF token (sans-IO).

Theory of operation: bound to a loopback address the console serves whoever reaches it (the
node's own users, like the API's socket), but only under a Host header naming loopback, so a
page elsewhere cannot reach it through DNS rebinding. Bound elsewhere it needs the access token:
a cookie set by visiting /login?token=... once, or an `Authorization: Bearer` header. Whatever
the binding, a request that changes anything (a POST) must come from the console's own origin
(Origin, or Sec-Fetch-Site: same-origin when the browser sends no Origin; neither: refused)
and carry the CSRF token the page got in its meta tag, in the X-CSRF-Token header.
Every comparison of secrets is constant-time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

import attrs

COOKIE = "feos_console"
TOKEN_FILE = "web-token"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_or_make_token(state_dir: Path) -> tuple[str, bool]:
    """The access token kept in <state-dir>/web-token (mode 0600); True if made just now."""
    path = state_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if token:
            os.chmod(path, 0o600)
            return token, False
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


@attrs.frozen
class Guard:
    """The checks of one console: `token` is None when it is bound to loopback."""

    csrf: str
    token: str | None = None

    def refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """None if the request may go on, else (HTTP status, why)."""
        host = headers.get("host", "")
        if self.token is None and not is_loopback(_host_name(host)):
            return 421, "the console answers only to a loopback Host"
        if self.token is not None and not self.authenticated(headers):
            return 401, "the console needs its access token (/login?token=...)"
        if method not in ("GET", "HEAD") and not self.same_origin(headers):
            return 403, "a change must come from the console's own page"
        if method not in ("GET", "HEAD") and not _same(headers.get("x-csrf-token", ""), self.csrf):
            return 403, "a change needs the page's CSRF token"
        return None

    def authenticated(self, headers: dict[str, str]) -> bool:
        assert self.token is not None
        bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
        cookie = _cookie(headers.get("cookie", ""), COOKIE)
        return any(_same(given, self.token) for given in (bearer, cookie) if given)

    def same_origin(self, headers: dict[str, str]) -> bool:
        origin = headers.get("origin")
        if origin is not None:
            host = headers.get("host", "")
            return origin in (f"http://{host}", f"https://{host}")
        return headers.get("sec-fetch-site", "") == "same-origin"

    def login(self, given: str) -> bool:
        return self.token is not None and _same(given, self.token)
