"""The agent's registry client and image store against a real registry (Debian's docker-registry).

The registry runs on 127.0.0.1 with a throwaway config and storage. docker-registry does Bearer
tokens only with a token server, so the tests that need a token put the registry behind a small
stdlib proxy that demands one fixed Bearer token (401 with a challenge otherwise) and passes the
rest on: the client's side of the protocol is the same. The image is made here, without network:
a layer tar of busybox-static and its applets, pushed with the registry's v2 API.

The integration test imports the helpers of this module (Registry, AuthProxy, push_busybox).
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import http.server
import io
import json
import os
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import capnp
import pytest

from feos.errors import Code, FeosError
from feos.guest._images import ImageStore
from feos.guest._registry import Client
from feos.guest._token import PullToken
from feos.guest._validate import reference

TOKEN = "s3cret-pull-token-for-tests"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
APPLETS = ("sh", "echo", "cat", "sleep", "ls", "env", "id", "ip", "hostname", "true", "false", "wc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server ended ({proc.returncode}) before it listened")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


class Registry:
    """docker-registry serving from a directory, on 127.0.0.1:<port>, on addr if given."""

    def __init__(self, directory: str, addr: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.addr = addr
        config = os.path.join(directory, "config.yml")
        with open(config, "w") as f:
            f.write(
                "version: 0.1\nlog: {level: error}\n"
                f"storage: {{filesystem: {{rootdirectory: {directory}/storage}}}}\n"
                f"http: {{addr: '{addr}:{self.port}'}}\n"
            )
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", config], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        wait_port(self.port, self.proc)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


class AuthProxy:
    """Passes GETs on to a registry when they carry `Authorization: Bearer TOKEN` (and, with
    anonymous, when they carry none: a public repository's pull), else 401 with a challenge, as a
    registry refuses a token it does not accept even for a public repository. Each GET's path and
    Authorization are kept in `seen` and, with log, written as a line `PATH token|-`."""

    def __init__(self, upstream: str, token: str = TOKEN, bind: str = "127.0.0.1", port: int = 0,
                 anonymous: bool = False, log: str = "") -> None:  # fmt: skip
        self.seen: list[tuple[str, str]] = []  # (path, Authorization or "")
        proxy = self
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization", "")
                with lock:
                    proxy.seen.append((self.path, auth))
                    if log:
                        with open(log, "a") as f:
                            f.write(f"{self.path} {'token' if auth else '-'}\n")
                if auth != f"Bearer {token}" and (auth or not anonymous):
                    message = b"invalid token" if auth else b"authentication required"
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"%s"}]}' % message
                    self.send_response(401)
                    self.send_header(
                        "WWW-Authenticate", 'Bearer realm="feos-test",error="invalid_token"'
                    )
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection(upstream, timeout=30)
                conn.request(
                    "GET", self.path, headers={"Accept": self.headers.get("Accept", "*/*")}
                )
                resp = conn.getresponse()
                body = resp.read()
                self.send_response(resp.status)
                for key in ("Content-Type", "Docker-Content-Digest", "Location"):
                    if resp.getheader(key):
                        self.send_header(key, resp.getheader(key) or "")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                conn.close()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((bind, port), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def seen_auth(self) -> list[str]:
        return [auth for _, auth in self.seen]

    def blobs(self) -> list[str]:
        return [path for path, _ in self.seen if "/blobs/" in path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# Making and pushing images ------------------------------------------------------------------


def tar_of(files: dict[str, bytes | str], mode: int = 0o755, dirs: bool = True) -> bytes:
    """A layer: names to contents (bytes) or symlink targets ("->target")."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parents = sorted({os.path.dirname(n) for n in files if os.path.dirname(n)} if dirs else ())
        for d in parents:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1
            tar.addfile(info)
        for name, content in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.mtime = 1
            if isinstance(content, str) and content.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, content[2:]
                tar.addfile(info)
            else:
                data = content.encode() if isinstance(content, str) else content
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def busybox_layer() -> bytes:
    with open("/bin/busybox", "rb") as f:
        busybox = f.read()
    files: dict[str, bytes | str] = {"bin/busybox": busybox}
    files.update({f"bin/{a}": "->busybox" for a in APPLETS})
    files["etc/passwd"] = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
    files["etc/group"] = "root:x:0:\nnogroup:x:65534:\n"
    files["etc/hostname"] = "image\n"
    return tar_of(files)


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def push_blob(host: str, repo: str, data: bytes) -> str:
    digest = digest_of(data)
    conn = http.client.HTTPConnection(host, timeout=30)
    conn.request("POST", f"/v2/{repo}/blobs/uploads/")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 202, resp.status
    location = resp.getheader("Location") or ""
    sep = "&" if "?" in location else "?"
    path = location.split(host, 1)[-1] if "://" in location else location
    conn.request(
        "PUT",
        f"{path}{sep}digest={digest}",
        body=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 201, (resp.status, resp.reason)
    return digest


def push_manifest(host: str, repo: str, tag: str, doc: dict[str, Any], media: str) -> str:
    body = json.dumps(doc).encode()
    conn = http.client.HTTPConnection(host, timeout=30)
    conn.request("PUT", f"/v2/{repo}/manifests/{tag}", body=body, headers={"Content-Type": media})
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    assert resp.status == 201, (resp.status, text)
    return digest_of(body)


def push_image(
    host: str, repo: str, tag: str, layers: list[bytes], config: dict[str, Any], arch: str = "amd64"
) -> str:
    """Pushes an OCI image; returns its manifest's digest."""
    cfg = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [digest_of(x) for x in layers]},
        }
    ).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": push_blob(host, repo, cfg),
            "size": len(cfg),
        },
        "layers": [
            {"mediaType": OCI_LAYER, "digest": push_blob(host, repo, x), "size": len(x)}
            for x in layers
        ],
    }
    return push_manifest(host, repo, tag, manifest, OCI_MANIFEST)


def push_busybox(host: str, repo: str = "feos/busybox", tag: str = "1") -> str:
    config = {
        "Env": ["PATH=/bin", "FROM_IMAGE=yes"],
        "Cmd": ["/bin/sh", "-c", "echo hello from the image"],
        "WorkingDir": "/",
    }
    return push_image(host, repo, tag, [busybox_layer()], config)


# Fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(str(tmp_path_factory.mktemp("registry")))
    try:
        yield reg
    finally:
        reg.close()


@pytest.fixture(scope="module")
def proxy(registry: Registry) -> Iterator[AuthProxy]:
    p = AuthProxy(registry.host)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def busybox(registry: Registry) -> str:
    return push_busybox(registry.host)


# The client ---------------------------------------------------------------------------------


def test_manifest_and_blobs_of_a_pushed_image(
    registry: Registry, busybox: str, tmp_path: Any
) -> None:
    client = Client(reference("r", f"{registry.host}/feos/busybox:1"), None)
    digest, manifest = client.manifest()
    assert digest == busybox
    layer = manifest["layers"][0]["digest"]
    client.blob(layer, str(tmp_path / "layer"))
    assert digest_of((tmp_path / "layer").read_bytes()) == layer


def test_an_index_gives_its_linux_amd64_manifest(registry: Registry) -> None:
    amd64 = push_image(
        registry.host, "feos/multi", "amd64", [tar_of({"arch": "amd64"})], {}, "amd64"
    )
    arm64 = push_image(
        registry.host, "feos/multi", "arm64", [tar_of({"arch": "arm64"})], {}, "arm64"
    )
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": d,
                "size": 1,
                "platform": {"os": "linux", "architecture": a},
            }
            for d, a in ((arm64, "arm64"), (amd64, "amd64"))
        ],
    }
    push_manifest(registry.host, "feos/multi", "latest", index, OCI_INDEX)
    digest, _ = Client(reference("r", f"{registry.host}/feos/multi"), None).manifest()
    assert digest == amd64


def test_a_missing_image_is_not_found(registry: Registry) -> None:
    with pytest.raises(FeosError) as e:
        Client(reference("r", f"{registry.host}/feos/nothing:1"), None).manifest()
    assert e.value.code == Code.NOT_FOUND
    assert "404" in e.value.message


def test_the_right_token_pulls_through_the_proxy(proxy: AuthProxy, busybox: str) -> None:
    digest, _ = Client(reference("r", f"{proxy.host}/feos/busybox:1"), PullToken(TOKEN)).manifest()
    assert digest == busybox
    assert proxy.seen_auth[-1] == f"Bearer {TOKEN}"


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_no_or_a_wrong_token_is_refused_naming_the_answer(
    proxy: AuthProxy, busybox: str, token: str | None
) -> None:
    ref = reference("r", f"{proxy.host}/feos/busybox:1")
    with pytest.raises(FeosError) as e:
        Client(ref, PullToken(token) if token else None).manifest()
    assert e.value.code == Code.UNAUTHENTICATED
    assert "401 Unauthorized" in e.value.message
    assert 'realm="feos-test"' in e.value.message
    assert ("invalid token" if token else "authentication required") in e.value.message
    assert token is None or token not in e.value.message


def test_a_token_never_shows() -> None:
    token = PullToken(TOKEN)
    assert TOKEN not in repr(token)
    assert TOKEN not in str(token)
    assert TOKEN not in f"{[token]}"
    with pytest.raises(TypeError):
        __import__("pickle").dumps(token)


def test_nothing_listening_is_unavailable() -> None:
    with pytest.raises(FeosError) as e:
        Client(reference("r", f"127.0.0.1:{free_port()}/x:1"), None).manifest()
    assert e.value.code == Code.UNAVAILABLE


# The store ----------------------------------------------------------------------------------


def test_concurrent_pulls_join_and_the_store_keeps_the_image(
    registry: Registry, busybox: str, tmp_path: Any
) -> None:
    store = ImageStore(str(tmp_path))
    ref = f"{registry.host}/feos/busybox:1"

    async def pulls() -> list[tuple[Any, bool]]:
        return list(
            await asyncio.gather(
                store.pull(ref, None), store.pull(ref, None), store.pull(ref, None)
            )
        )

    results = asyncio.run(capnp.run(pulls()))
    assert [joined for _, joined in results].count(False) == 1
    assert {image.digest for image, _ in results} == {busybox}
    found = store.find(reference("r", ref))
    assert found is not None
    assert found.digest == busybox
    assert found.config["Cmd"] == ["/bin/sh", "-c", "echo hello from the image"]
    rootfs = tmp_path / "rootfs"
    store.unpack(found, str(rootfs))
    assert os.readlink(rootfs / "bin" / "sh") == "busybox"
    assert (rootfs / "bin" / "busybox").stat().st_size > 100_000


def test_whiteouts_remove_what_layers_below_put(registry: Registry, tmp_path: Any) -> None:
    lower = tar_of({"a/keep": "1", "a/gone": "2", "b/old": "3", "c": "4"})
    upper = tar_of({"a/.wh.gone": "", "b/.wh..wh..opq": "", "b/new": "5", ".wh.c": ""})
    push_image(registry.host, "feos/layers", "1", [lower, upper], {})
    store = ImageStore(str(tmp_path))
    image, _ = asyncio.run(capnp.run(store.pull(f"{registry.host}/feos/layers:1", None)))
    rootfs = tmp_path / "rootfs"
    store.unpack(image, str(rootfs))
    found = sorted(str(p.relative_to(rootfs)) for p in rootfs.rglob("*"))
    assert found == ["a", "a/keep", "b", "b/new"]


def test_a_layer_cannot_write_outside_the_rootfs(registry: Registry, tmp_path: Any) -> None:
    evil = tar_of({"../../escaped": "x"})
    push_image(registry.host, "feos/evil", "1", [evil], {})
    store = ImageStore(str(tmp_path / "store"))
    with pytest.raises(FeosError) as e:  # the pull unpacks its layers: the image is refused
        asyncio.run(capnp.run(store.pull(f"{registry.host}/feos/evil:1", None)))
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "outside the rootfs" in e.value.message
    assert not (tmp_path / "escaped").exists()
    assert store.find(reference("image", f"{registry.host}/feos/evil:1")) is None


def test_a_layer_cannot_write_through_a_symlink_out(registry: Registry, tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    lower = tar_of({"link": f"->{outside}"})
    upper = tar_of({"link/planted": "x"}, dirs=False)  # no entry for link/ itself
    push_image(registry.host, "feos/evil", "2", [lower, upper], {})
    store = ImageStore(str(tmp_path / "store"))
    image, _ = asyncio.run(capnp.run(store.pull(f"{registry.host}/feos/evil:2", None)))
    # Each layer in a directory of its own: the upper's link/ is its own directory (overlayfs
    # shows it over the lower's symlink, as docker's overlay2 does); nothing lands outside.
    lower, upper = store.unpack_layers(image)
    assert os.path.islink(os.path.join(lower, "link"))
    assert os.path.isfile(os.path.join(upper, "link", "planted"))
    assert not (outside / "planted").exists()
    with pytest.raises(FeosError) as e:  # the copy into one rootfs (no overlayfs) refuses it
        store.unpack(image, str(tmp_path / "store" / "rootfs"))
    assert "goes through a link out of the rootfs" in e.value.message
    assert not (outside / "planted").exists()


if __name__ == "__main__":  # the integration test runs the proxy in a namespace of its own
    import sys

    server = AuthProxy(sys.argv[1], bind=sys.argv[2], port=int(sys.argv[3]))
    print("listening", flush=True)
    server.thread.join()
