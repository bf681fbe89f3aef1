"""A small OCI distribution (v2) client on http.client: manifests, indexes, blobs, Bearer tokens.

Blocking: the image store runs it on a worker thread. A registry named by an IP address or
`localhost` is spoken to over plain HTTP, any other over HTTPS (docs/guest.md). Plain HTTP goes
through feos.guest._http, not http.client: http.client's import costs a quarter of a second of
the guest's vCPU under TCG, on every pod's first pull; HTTPS imports http.client (and ssl) when
it is first needed.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from feos.errors import Code, FeosError

from . import _http
from ._images import sha256
from ._token import PullToken
from ._validate import Reference

TYPE_CHECKING = False  # mypy takes it as true; typing costs the first pull tens of ms under TCG
if TYPE_CHECKING:
    import urllib.parse  # at run time only for a redirect or a token's realm: 33 ms under TCG
    from typing import Any

INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
MAX_MANIFEST = 4 << 20
TIMEOUT = 30.0
PLATFORM = ("linux", "amd64")


def api_host(registry: str) -> str:
    return "registry-1.docker.io" if registry == "docker.io" else registry


def plain_http(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.find("]")]
    if name == "localhost":
        return True
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, name)
            return True
        except OSError:
            pass
    return False


def pick_platform(index: dict[str, Any], ref: Reference) -> str:
    """The digest of the linux/amd64 manifest of an index."""
    for entry in index.get("manifests") or []:
        platform = entry.get("platform") or {}
        if (platform.get("os"), platform.get("architecture")) == PLATFORM:
            return str(entry["digest"])
    raise FeosError(Code.NOT_FOUND, f"image {ref.key} has no linux/amd64 manifest in its index")


class Client:
    """One image's registry session: the token it was given, or one it fetched anonymously."""

    def __init__(self, ref: Reference, token: PullToken | None) -> None:
        self.ref = ref
        self.host = api_host(ref.registry)
        self.token = token
        self._anonymous: str | None = None

    def manifest(self) -> tuple[str, dict[str, Any]]:
        """The image's manifest (through its index if it has one) and its digest."""
        digest, doc = self._manifest(self.ref.digest or self.ref.tag)
        if doc.get("mediaType") in INDEX_TYPES or "manifests" in doc:
            digest, doc = self._manifest(pick_platform(doc, self.ref))
        if not isinstance(doc.get("layers"), list) or not isinstance(doc.get("config"), dict):
            raise FeosError(Code.FAILED_PRECONDITION, f"{self.ref.key}: not an image manifest")
        return digest, doc

    def blob(self, digest: str, dest: str) -> None:
        """Downloads a blob into dest (via dest.part), checking its digest."""
        resp, conn = self._get(f"/v2/{self.ref.repository}/blobs/{digest}", "*/*")
        try:
            h = sha256()
            with open(dest + ".part", "wb") as f:
                while chunk := resp.read(1 << 20):
                    h.update(chunk)
                    f.write(chunk)
        finally:
            conn.close()
        if f"sha256:{h.hexdigest()}" != digest:
            os.unlink(dest + ".part")
            raise FeosError(
                Code.DATA_LOSS, f"{self.ref.key}: blob {digest} arrived with another digest"
            )
        os.replace(dest + ".part", dest)

    def _manifest(self, tag_or_digest: str) -> tuple[str, dict[str, Any]]:
        accept = ", ".join(INDEX_TYPES + MANIFEST_TYPES)
        resp, conn = self._get(f"/v2/{self.ref.repository}/manifests/{tag_or_digest}", accept)
        try:
            body = resp.read(MAX_MANIFEST + 1)
        finally:
            conn.close()
        if len(body) > MAX_MANIFEST:
            raise FeosError(Code.RESOURCE_EXHAUSTED, f"{self.ref.key}: manifest over 4 MiB")
        digest = "sha256:" + sha256(body).hexdigest()
        if tag_or_digest.startswith("sha256:") and digest != tag_or_digest:
            raise FeosError(
                Code.DATA_LOSS, f"{self.ref.key}: manifest {tag_or_digest} has another digest"
            )
        try:
            doc = json.loads(body)
        except ValueError:
            raise FeosError(
                Code.FAILED_PRECONDITION, f"{self.ref.key}: manifest is not JSON"
            ) from None
        if not isinstance(doc, dict):
            raise FeosError(Code.FAILED_PRECONDITION, f"{self.ref.key}: manifest is not an object")
        return digest, doc

    def _get(self, path: str, accept: str) -> tuple[Any, Any]:
        resp, conn = self._request(self.host, path, accept, self._auth())
        if resp.status == 401 and self.token is None and self._anonymous is None:
            challenge = resp.getheader("WWW-Authenticate") or ""
            refused = self._refusal(resp)
            conn.close()
            self._anonymous = self._fetch_anonymous(challenge)
            if not self._anonymous:
                raise refused
            resp, conn = self._request(self.host, path, accept, self._auth())
        for _ in range(5):  # blobs redirect to storage elsewhere, which gets no token
            if resp.status not in (301, 302, 303, 307, 308):
                break
            import urllib.parse

            target = urllib.parse.urlsplit(resp.getheader("Location") or "")
            conn.close()
            resp, conn = self._request_url(target, accept)
        if resp.status != 200:
            error = self._refusal(resp)
            conn.close()
            raise error
        return resp, conn

    def _auth(self) -> str | None:
        secret = self.token.reveal() if self.token else self._anonymous
        return f"Bearer {secret}" if secret else None

    def _request(
        self, host: str, path: str, accept: str, auth: str | None, scheme: str = ""
    ) -> tuple[Any, Any]:
        scheme = scheme or ("http" if plain_http(host) else "https")
        conn = self._connection(scheme, host)
        headers = {"Accept": accept, "User-Agent": "feos-guest"}
        if auth:
            headers["Authorization"] = auth
        try:
            conn.request("GET", path, headers=headers)
            return conn.getresponse(), conn
        except (OSError, *_http_errors()) as e:  # type: ignore[misc]
            conn.close()
            raise FeosError(Code.UNAVAILABLE, f"registry {host}: {type(e).__name__}: {e}") from None

    def _request_url(self, url: urllib.parse.SplitResult, accept: str) -> tuple[Any, Any]:
        if url.scheme not in ("http", "https") or not url.netloc:
            raise FeosError(
                Code.UNAVAILABLE, f"registry {self.host}: a redirect to {url.geturl()!r}"
            )
        path = url.path + (f"?{url.query}" if url.query else "")
        same = url.netloc == self.host
        return self._request(url.netloc, path, accept, self._auth() if same else None, url.scheme)

    @staticmethod
    def _connection(scheme: str, host: str) -> Any:
        if scheme == "http":
            return _http.Connection(host, timeout=TIMEOUT)
        import http.client  # only for registries over HTTPS
        import ssl

        return http.client.HTTPSConnection(
            host, timeout=TIMEOUT, context=ssl.create_default_context()
        )

    def _refusal(self, resp: Any) -> FeosError:
        """The registry's answer, named: its status, its challenge and the start of its body."""
        body = resp.read(512).decode("utf-8", "replace").strip()
        challenge = resp.getheader("WWW-Authenticate")
        said = f"{resp.status} {resp.reason}" + (
            f", WWW-Authenticate: {challenge}" if challenge else ""
        )
        said += f": {body}" if body else ""
        code = {401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED, 404: Code.NOT_FOUND}.get(
            resp.status, Code.UNAVAILABLE
        )
        given = "with the pull token given" if self.token else "without a pull token"
        return FeosError(code, f"registry {self.host} refused {self.ref.key} {given}: {said}")

    def _fetch_anonymous(self, challenge: str) -> str:
        """Docker's token protocol for anonymous pulls: ask the challenge's realm for a token."""
        scheme, _, params = challenge.partition(" ")
        fields = dict(_challenge_fields(params))
        if scheme.lower() != "bearer" or "realm" not in fields:
            return ""
        import urllib.parse

        realm = urllib.parse.urlsplit(fields["realm"])
        asked: dict[str, str] = {k: fields[k] for k in ("service", "scope") if k in fields}
        asked.setdefault("scope", f"repository:{self.ref.repository}:pull")
        query = urllib.parse.urlencode(asked)
        url = realm._replace(query=(realm.query + "&" if realm.query else "") + query)
        try:
            resp, conn = self._request_url(url, "application/json")
        except FeosError:
            return ""
        try:
            if resp.status != 200:
                return ""
            doc = json.loads(resp.read(1 << 20))
        except ValueError:
            return ""
        finally:
            conn.close()
        return str(doc.get("token") or doc.get("access_token") or "")


def _http_errors() -> tuple[type[Exception], ...]:
    """http.client's errors once it is loaded (an HTTPS pull); plain HTTP's are OSErrors."""
    loaded = sys.modules.get("http.client")
    return (loaded.HTTPException,) if loaded is not None else ()


def _challenge_fields(params: str) -> list[tuple[str, str]]:
    out = []
    for part in params.split(","):
        key, eq, value = part.strip().partition("=")
        if eq:
            out.append((key.strip(), value.strip().strip('"')))
    return out
