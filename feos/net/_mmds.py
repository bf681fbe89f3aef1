"""The metadata contract (node.md, "Metadata"), pure: the object, its validation, and MMDS
version 2 as Firecracker serves it, over requests that feos.net._mmds_http reads with h11.

Theory of operation. `MmdsStore.respond(request, now)` is MMDS version 2 as Firecracker does it:

- PUT /latest/api/token with X-metadata-token-ttl-seconds 1..21600 hands out a session token;
  a PUT with X-Forwarded-For is refused (400), as are a missing or bad TTL (400); a PUT to any
  other path is 404.
- GET needs X-metadata-token naming an unexpired token, else 401; the path is a JSON pointer
  into the object ('//' collapsed, a trailing '/' ignored). With Accept: application/json the
  answer is the value as compact JSON; otherwise a string is given as text, an object as its
  keys one per line, a key whose value is an object with a trailing '/', and any other value is
  501, as in Firecracker's IMDS format. A missing path is 404.
- Any other method is 405 with Allow: GET, PUT.

The AWS spellings of the token headers (X-aws-ec2-metadata-token...) are taken as well.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from feos.errors import invalid

MAX_METADATA_BYTES = 32 * 1024
MAX_KEY_LENGTH = 128
_KEY = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
TOKEN_PATH = "/latest/api/token"
MIN_TTL, MAX_TTL = 1, 21600
MAX_TOKENS = 1024  # per pod: a guest that asks for more loses its oldest
TOKEN_HEADERS = ("x-metadata-token", "x-aws-ec2-metadata-token")
TTL_HEADERS = ("x-metadata-token-ttl-seconds", "x-aws-ec2-metadata-token-ttl-seconds")



# --- the object and its validation ----------------------------------------------------------


def validate_metadata(metadata: object) -> dict[str, Any]:
    """PodSpec.metadata: an object, keys of 1 to 128 of [A-Za-z0-9._-], at most 32 KiB as JSON."""
    if not isinstance(metadata, dict):
        raise invalid("spec.metadata", "must be a JSON object")
    _check_keys(metadata, "spec.metadata")
    try:
        size = len(json.dumps(metadata, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError) as e:
        raise invalid("spec.metadata", f"must be JSON ({e})") from None
    if size > MAX_METADATA_BYTES:
        raise invalid("spec.metadata", f"is {size} bytes as JSON, more than 32 KiB")
    return metadata


def _check_keys(value: object, where: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or not _KEY.match(k):
                raise invalid(f"{where}.{k}"[:200], "keys are 1 to 128 letters, digits, -, _ or .")
            _check_keys(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_keys(v, f"{where}[{i}]")


def metadata_object(pod_id: str, ipv6: str, ipv4: str, metadata: Mapping[str, Any]) -> dict[
    str, Any
]:
    """The object the metadata service holds: the pod on this node, and the spec's metadata."""
    return {"feos": {"pod-id": pod_id, "ipv6": ipv6, "ipv4": ipv4}, "metadata": dict(metadata)}


# --- HTTP/1.1 requests, as feos.net._mmds_http reads them ------------------------------------


@attrs.frozen
class Request:
    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]  # names in lower case, in order
    body: bytes = b""

    def header(self, *names: str) -> str | None:
        for k, v in self.headers:
            if k in names:
                return v
        return None

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


@attrs.frozen
class BadRequest:
    """A request the service refuses before it reads it (feos.net._mmds_http): answer, close."""

    status: int
    reason: str


# --- responses ------------------------------------------------------------------------------


@attrs.frozen
class Response:
    status: int
    body: str
    content_type: str = "text/plain"
    allow: str | None = None


def bad_request_response(bad: BadRequest) -> Response:
    return Response(bad.status, bad.reason)


# --- MMDS version 2 -------------------------------------------------------------------------


@attrs.define
class MmdsStore:
    """One pod's metadata and the session tokens handed out to it."""

    data: dict[str, Any]
    random_bytes: Callable[[int], bytes]
    tokens: dict[str, float] = attrs.Factory(dict)  # token -> when it expires

    def respond(self, req: Request, now: float) -> Response:
        if req.method == "PUT":
            return self._put(req, now)
        if req.method == "GET":
            return self._get(req, now)
        return Response(405, "Not allowed HTTP method.", allow="GET, PUT")

    def _put(self, req: Request, now: float) -> Response:
        if req.header("x-forwarded-for") is not None:
            return Response(400, "Invalid header. Reason: Unsupported header name. Key: "
                                 "X-Forwarded-For")
        if sanitize_path(req.target) != TOKEN_PATH:
            return Response(404, f"Resource not found: {_path(req.target)}.")
        ttl_text = req.header(*TTL_HEADERS)
        if ttl_text is None:
            return Response(400, "Token time to live value not found. Use "
                                 "`X-metadata-token-ttl-seconds` header to specify the token's "
                                 "lifetime.")
        ttl = int(ttl_text) if ttl_text.isdigit() and len(ttl_text) < 10 else -1
        if not MIN_TTL <= ttl <= MAX_TTL:
            return Response(400, f"Invalid time to live value provided for token: {ttl_text}. "
                                 f"Please provide a value between {MIN_TTL} and {MAX_TTL}.")
        return Response(200, self._issue(ttl, now))

    def _issue(self, ttl: int, now: float) -> str:
        self.tokens = {t: e for t, e in self.tokens.items() if e > now}
        while len(self.tokens) >= MAX_TOKENS:
            del self.tokens[next(iter(self.tokens))]
        token = base64.urlsafe_b64encode(self.random_bytes(32)).decode().rstrip("=")
        self.tokens[token] = now + ttl
        return token

    def _get(self, req: Request, now: float) -> Response:
        token = req.header(*TOKEN_HEADERS)
        if token is None:
            return Response(401, "No MMDS token provided. Use `X-metadata-token` header to "
                                 "specify the session token.")
        expires = self.tokens.get(token)
        if expires is None or expires <= now:
            return Response(401, "MMDS token not valid.")
        return self.lookup(req.target, json_wanted=req.header("accept") == "application/json")

    def lookup(self, target: str, *, json_wanted: bool) -> Response:
        value = pointer(self.data, sanitize_path(target))
        if value is _MISSING:
            return Response(404, f"Resource not found: {_path(target)}.")
        if json_wanted:
            return Response(200, json.dumps(value, separators=(",", ":"), sort_keys=True),
                            "application/json")
        if isinstance(value, str):
            return Response(200, value)
        if isinstance(value, dict):
            keys = [k + "/" if isinstance(value[k], dict) else k for k in sorted(value)]
            return Response(200, "\n".join(keys))
        return Response(501, "Cannot retrieve value. The value has an unsupported type.")


_MISSING = object()


def _path(target: str) -> str:
    """The absolute path of a request target: origin form, or the path of an absolute URI."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    if "://" in path:
        rest = path.split("://", 1)[1]
        path = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    return path


def sanitize_path(target: str) -> str:
    path = _path(target)
    while "//" in path:
        path = path.replace("//", "/")
    return path


def pointer(doc: Any, path: str) -> Any:
    """The value at a JSON pointer (RFC 6901), a trailing '/' ignored; _MISSING if none."""
    if path.endswith("/"):
        path = path[:-1]
    if path == "":
        return doc
    if not path.startswith("/"):
        return _MISSING
    node = doc
    for raw in path[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
