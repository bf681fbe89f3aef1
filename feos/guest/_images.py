"""The image store on /data: blobs by digest, one record per pulled reference, layer unpacking.

<data>/images/blobs/sha256/<hex>   manifests' configs and layers, verified when they arrive
<data>/images/refs/<sha256 of key>.json   {"reference", "key", "digest", "config", "layers"}
<data>/images/layers/<hex>/   a layer unpacked once, an overlayfs lower of every container on it

A pull unpacks the layers it brought (so that a disk baked after a pull holds them ready, and a
container's create only mounts its overlay); each layer lands whole or not at all (unpacked
aside, synced, renamed).

A pull of a reference that is already pulling joins that pull (its token unused). A record is
written whole (write, rename) after its blobs, so a pull cut off leaves no record of a half image;
nothing is synced, and a record or a blob a crash of the guest cut short (its size is not the
manifest's) is taken for an image not pulled: the store is a cache of the registry.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from feos.errors import Code, FeosError

from . import _validate
from ._token import PullToken

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any

LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gz",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gz",
    "application/vnd.docker.image.rootfs.diff.tar": "",
}


def sha256(data: bytes = b"") -> Any:
    """A SHA-256 of Python's own (_sha2, _sha256 before 3.12), not hashlib's: hashlib loads
    OpenSSL's libcrypto, 40 ms of the guest's vCPU under TCG on a pod's first pull, for a hash
    of a layer's few MiB that is about as fast either way."""
    try:
        from _sha2 import sha256 as make  # type: ignore[import-not-found]
    except ImportError:
        try:
            from _sha256 import sha256 as make  # type: ignore[import-not-found]
        except ImportError:  # a Python built without them
            from hashlib import sha256 as make
    return make(data)


def write_whole(path: str, data: bytes, *, sync: bool = True) -> None:
    """The file replaced whole: its old content or the new one, never a part. Without sync a
    crash of the guest may keep the old one (ext4 writes a file renamed over another before the
    rename, auto_da_alloc), for a record whose change a crash undoes anyway."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


class Phases:
    """How long each part of a step took, for one console line (what a bring-up waits for)."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()
        self.parts: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.parts.append((name, now - self.last))
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {took:.3f}" for name, took in self.parts)
        return f"{self.last - self.started:.3f} s ({parts})"


def _size(descriptor: dict[str, Any]) -> int:
    """A descriptor's size, -1 when it names none (or not as a number)."""
    size = descriptor.get("size", -1)
    return size if isinstance(size, int) and not isinstance(size, bool) else -1


class Image:
    """A pulled image: its manifest digest, its config's runtime part, its layers in order."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.reference: str = record["reference"]
        self.digest: str = record["digest"]
        self.config: dict[str, Any] = record.get("config") or {}
        self.layers: list[tuple[str, str]] = [(d, c) for d, c in record["layers"]]


class ImageStore:
    def __init__(self, data_dir: str) -> None:
        self.root = os.path.join(data_dir, "images")
        self.blobs = os.path.join(self.root, "blobs", "sha256")
        self.refs = os.path.join(self.root, "refs")
        self.layers = os.path.join(self.root, "layers")
        self._pulls: dict[str, asyncio.Future[Image]] = {}
        self._unpacking: Any = None  # a threading.Lock, made when first needed

    def _ensure_dirs(self) -> None:
        os.makedirs(self.blobs, exist_ok=True)
        os.makedirs(self.refs, exist_ok=True)

    def blob_path(self, digest: str) -> str:
        algo, _, hexd = digest.partition(":")
        if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
            raise FeosError(Code.FAILED_PRECONDITION, f"unsupported digest {digest!r}")
        return os.path.join(self.blobs, hexd)

    def _ref_path(self, ref: _validate.Reference) -> str:
        return os.path.join(self.refs, sha256(ref.key.encode()).hexdigest() + ".json")

    def find(self, ref: _validate.Reference) -> Image | None:
        """The pulled image, or None: never pulled, or its record or one of its layers cut
        short by a crash (the pull writes nothing synced: the store is a cache of the registry,
        and what a crash cut is pulled again)."""
        try:
            with open(self._ref_path(ref), "rb") as f:
                record = json.load(f)
            image = Image(record)
            sizes = dict(record.get("sizes") or {})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        whole = all(self._blob_ok(d, int(sizes.get(d, -1))) for d, _ in image.layers)
        return image if whole else None

    def _blob_ok(self, digest: str, size: int) -> bool:
        """The blob is there whole: its size is the manifest's (ext4 keeps no size past the
        data a crash let it write), or, for a size not known, the file is there."""
        try:
            have = os.path.getsize(self.blob_path(digest))
        except OSError:
            return False
        return size < 0 or have == size

    async def pull(self, text: str, token: PullToken | None) -> tuple[Image, bool]:
        """Pulls text into the store: (the image, whether it joined a pull in flight)."""
        ref = _validate.reference("reference", text)
        running = self._pulls.get(ref.key)
        if running is not None:
            return await asyncio.shield(running), True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Image] = loop.create_future()
        self._pulls[ref.key] = fut
        try:
            image = await loop.run_in_executor(None, self._pull, text, ref, token)
            fut.set_result(image)
            return image, False
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody joined
            raise
        finally:
            del self._pulls[ref.key]

    async def ensure(self, text: str, token: PullToken | None) -> Image:
        """The image from the store, pulled first if the store lacks it."""
        ref = _validate.reference("image", text)
        return self.find(ref) or (await self.pull(text, token))[0]

    def _pull(self, text: str, ref: _validate.Reference, token: PullToken | None) -> Image:
        from . import _registry  # http.client: only once an image is pulled (boot time)

        phases = Phases()
        self._ensure_dirs()
        client = _registry.Client(ref, token)
        digest, manifest = client.manifest()
        phases.mark("manifest")
        config_digest = str(manifest["config"].get("digest", ""))
        self._fetch(client, config_digest, _size(manifest["config"]))
        with open(self.blob_path(config_digest), "rb") as f:
            config = json.load(f).get("config") or {}
        layers = []
        for layer in manifest["layers"]:
            media = str(layer.get("mediaType", ""))
            if media not in LAYER_TYPES:
                raise FeosError(Code.UNIMPLEMENTED, f"{ref.key}: layers of type {media!r}")
            self._fetch(client, str(layer.get("digest", "")), _size(layer))
            layers.append((layer["digest"], LAYER_TYPES[media]))
        phases.mark("blobs")
        record = {
            "reference": text,
            "key": ref.key,
            "digest": digest,
            "config": config,
            "layers": layers,
            "sizes": {str(d["digest"]): _size(d) for d in manifest["layers"]},
        }
        self.unpack_layers(Image(record))  # a layer that cannot be unpacked: no image
        phases.mark("unpack")
        # Not synced (10-20 ms alone, up to 0.2 s with ten guests on one disk): find() takes a
        # record or a layer that a crash cut short for an image not pulled.
        write_whole(self._ref_path(ref), json.dumps(record).encode(), sync=False)
        phases.mark("record")
        print(f"feos-guest: pulled {ref.key} in {phases.line()}", flush=True)
        return Image(record)

    def _fetch(self, client: Any, digest: str, size: int) -> None:
        if not self._blob_ok(digest, size):
            client.blob(digest, self.blob_path(digest))

    def layer_dir(self, digest: str) -> str:
        return os.path.join(self.layers, os.path.basename(self.blob_path(digest)))

    def unpack_layers(self, image: Image) -> list[str]:
        """The directories of the image's layers, lowest first, each unpacked once (blocking):
        into a directory aside, then synced and renamed, so that one that is there is whole.
        A directory left aside by an unpack that was cut off is removed."""
        import shutil  # its import (bz2, lzma) is 45 ms under TCG: not on the start path
        import threading

        from . import _unpack

        if self._unpacking is None:
            self._unpacking = threading.Lock()
        with self._unpacking:
            os.makedirs(self.layers, exist_ok=True)
            for entry in os.listdir(self.layers):
                if entry.endswith(".unpacking"):
                    shutil.rmtree(os.path.join(self.layers, entry), ignore_errors=True)
            made = []
            for digest, compression in image.layers:
                final = self.layer_dir(digest)
                if final not in made and not os.path.isdir(final):
                    _unpack.apply_layer(self.blob_path(digest), compression,
                                        final + ".unpacking", overlay=True)  # fmt: skip
                    made.append(final)
            if made:
                os.sync()  # what the rename says is whole is on the disk first
                for final in made:
                    os.rename(final + ".unpacking", final)
        return [self.layer_dir(d) for d, _ in image.layers]

    def unpack(self, image: Image, dest: str) -> None:
        """Extracts the image's layers into dest in order, applying their whiteouts (blocking)."""
        from . import _unpack  # only when a container is made

        for digest, compression in image.layers:
            _unpack.apply_layer(self.blob_path(digest), compression, dest)
