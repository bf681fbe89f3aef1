"""The object store: layers to and from an S3 bucket as content-addressed chunks.

docs/disk-store.md has the layout, the manifest, the checks, the tries and the timeouts.

Keys, under the configured prefix: `chunks/<hex>` holds a chunk whose sha256 is <hex>;
`layers/<hex>.json` the manifest of the layer whose file's sha256 is <hex>; `memory/<hex>.json`
that of a memory snapshot (a pod's hibernated memory), whose chunks are stored the same way. A
push uploads the chunks the bucket lacks (HEAD first) and the manifest last, so a manifest is
there only when all of its chunks are. A pull takes every chunk from the node's ChunkCache or
the bucket, checks each against its digest before it goes into the layer, and the assembled file
against the layer's.

Every request has three tries (boto's own retries are off: one request is one try, with short
connect and read timeouts); a refusal that another try cannot change (a 4xx but throttling) ends
at once. What is left fails with UNAVAILABLE and the store's own words: boto's error code and
message, or the endpoint's connection error. The methods block: diskd calls them on threads, and
one ObjectStore serves several threads at once (boto3's clients are thread-safe).
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import boto3
import botocore.config
import botocore.exceptions

from ..errors import Code, FeosError
from ..records import fsync_dir
from ._chunks import (
    CHUNK_SIZE,
    ChunkCache,
    chunk_count,
    chunk_hex,
    is_chunk_hex,
    pwrite_all,
    read_chunks,
    unlink_quietly,
    zeroes,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
M = TypeVar("M", "LayerManifest", "MemoryManifest")

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})\Z")
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]\Z")
_ENDPOINT = re.compile(r"https?://[^/\s?#]+/?\Z")
_FORMATS = ("qcow2", "raw")
_MAX_CHUNK_SIZE = 64 * 1024 * 1024
_MAX_CHECKPOINT = 1024 * 1024
_MAX_MANIFEST = 256 * 1024 * 1024  # 16 TiB in 4 MiB chunks: 4 Mi entries of 67 bytes
_RETRYABLE_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}  # fmt: skip
_ABSENT_CODES = {"404", "NoSuchKey", "NotFound"}


def digest_hex(digest: str, field: str = "digest") -> str:
    """The 64 hex digits of a layer digest "sha256:<hex>"; INVALID_ARGUMENT otherwise."""
    match = _DIGEST.match(digest) if isinstance(digest, str) else None
    if match is None:
        raise FeosError(Code.INVALID_ARGUMENT, f"{field}: {digest!r} is not sha256:<64 hex>")
    return match.group(1)


def layer_file_name(digest: str) -> str:
    """The name of a layer's file in diskd's layers/: "sha256-<hex>" (diskd's own rule, as
    feos.disk._model.layer_file has it: a colon in a file name reads as a protocol to QEMU)."""
    return f"sha256-{digest_hex(digest)}"


# -- the store's configuration ---------------------------------------------------------------


@attrs.frozen
class StoreConfig:
    """Where the layers go: a bucket, its endpoint ("" for AWS's own) and credentials.

    Without keys boto3's own chain finds credentials (the instance's metadata, ~/.aws).
    """

    bucket: str
    endpoint: str = ""
    region: str = "us-east-1"
    prefix: str = ""  # "" or ending in "/"
    access_key_id: str = attrs.field(default="", repr=False)
    secret_access_key: str = attrs.field(default="", repr=False)
    session_token: str = attrs.field(default="", repr=False)
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0  # the longest silence within an answer, not its whole time
    tries: int = 3
    retry_delay_s: float = 0.5  # before the second try; doubled before the third
    concurrency: int = 8  # requests in flight for one push or pull

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], options: argparse.Namespace | Mapping[str, Any] | None = None
    ) -> tuple[StoreConfig | None, str]:
        """The store as diskd's options and environment (/etc/default/diskd) name it.

        (config, "") when a bucket is named, (None, why not) otherwise; INVALID_ARGUMENT naming
        the variable or option when one is malformed. Options win over the environment.
        """
        opts = vars(options) if isinstance(options, argparse.Namespace) else dict(options or {})

        def pick(option: str, *names: str) -> str:
            value = opts.get(option)
            if value:
                return str(value)
            return next((env[n] for n in names if env.get(n)), "")

        bucket = pick("s3_bucket", "S3_BUCKET")
        if not bucket:
            return None, "no object store: S3_BUCKET (or --s3-bucket) is not set"
        if not _BUCKET.match(bucket):
            raise FeosError(Code.INVALID_ARGUMENT, f"S3_BUCKET: {bucket!r} is not a bucket name")
        endpoint = pick("s3_endpoint", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint and not _ENDPOINT.match(endpoint):
            raise FeosError(Code.INVALID_ARGUMENT, f"AWS_ENDPOINT_URL (--s3-endpoint): "
                            f"{endpoint!r} is not http(s)://host[:port]")  # fmt: skip
        key, secret = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
        if bool(key) != bool(secret):
            raise FeosError(Code.INVALID_ARGUMENT, "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: "
                            "one is set without the other")  # fmt: skip
        prefix = pick("s3_prefix", "S3_PREFIX").strip("/")
        return cls(
            bucket=bucket,
            endpoint=endpoint.rstrip("/"),
            region=pick("s3_region", "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
            prefix=f"{prefix}/" if prefix else "",
            access_key_id=key,
            secret_access_key=secret,
            session_token=env.get("AWS_SESSION_TOKEN", ""),
        ), ""


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """diskd's options for the object store (each also an environment variable)."""
    group = parser.add_argument_group("object store (else S3_BUCKET, AWS_* in the environment)")
    group.add_argument("--s3-bucket", metavar="NAME", help="the bucket (S3_BUCKET)")
    group.add_argument("--s3-endpoint", metavar="URL", help="an S3 endpoint (AWS_ENDPOINT_URL)")
    group.add_argument("--s3-region", metavar="REGION", help="(AWS_REGION, AWS_DEFAULT_REGION)")
    group.add_argument("--s3-prefix", metavar="PREFIX", help="a key prefix (S3_PREFIX)")


# -- the manifest ----------------------------------------------------------------------------


@attrs.frozen
class LayerManifest:
    """A layer as the store keeps it: what it is, and its chunks in order (None: a hole)."""

    digest: str
    parent: str  # "" for an L0
    size_bytes: int
    virtual_bytes: int
    guest: str
    image: str
    format: str
    chunk_size: int = CHUNK_SIZE
    chunks: tuple[str | None, ...] = ()
    created_unix_ns: int = 0

    def to_json(self) -> bytes:
        record = attrs.asdict(self)
        record["chunks"] = list(self.chunks)
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, text: bytes | str, code: Code = Code.DATA_LOSS) -> LayerManifest:
        """Strict: every field there with its type and range, no other; `code` and the field's
        name otherwise (DATA_LOSS for a manifest from the store)."""
        return cls.from_record(_record(text, code, "layer manifest"), code)

    @classmethod
    def from_record(cls, record: object, code: Code = Code.DATA_LOSS) -> LayerManifest:
        if not isinstance(record, dict):
            raise FeosError(code, "layer manifest: not a JSON object")
        return _checked_manifest(record, code)

    @property
    def what(self) -> str:
        return f"layer {self.digest}"


class _Fields:
    """The checks of a manifest's fields: each one's type and range, `code` and its name when
    it is wrong."""

    def __init__(self, record: dict[str, Any], code: Code, what: str) -> None:
        self.record, self.code, self.what = record, code, what

    def bad(self, field: str, rule: str) -> FeosError:
        return FeosError(self.code, f"{self.what}: field {field!r}: {rule}")

    def strict(self, names: Iterable[str]) -> None:
        names = set(names)
        if extra := sorted(set(self.record) - names):
            raise FeosError(self.code, f"{self.what}: unknown field {extra[0]!r}")
        if missing := sorted(names - set(self.record)):
            raise FeosError(self.code, f"{self.what}: field {missing[0]!r} is missing")

    def text(self, field: str, pattern: re.Pattern[str] | None = None, empty: bool = True) -> str:
        value = self.record[field]
        if not isinstance(value, str) or len(value) > 4096:
            raise self.bad(field, "not a string (of at most 4096 characters)")
        if pattern is not None and not (empty and value == "") and not pattern.match(value):
            raise self.bad(field, f"{value!r} is not sha256:<64 hex>")
        return value

    def number(self, field: str, low: int, high: int = 2**63 - 1) -> int:
        value = self.record[field]
        if type(value) is not int or not low <= value <= high:
            raise self.bad(field, f"not an integer from {low} to {high}")
        return value

    def chunks(self, size_bytes: int, chunk_size: int) -> tuple[str | None, ...]:
        """The chunk list: one entry per chunk of the file, each null or a chunk's hex."""
        chunks = self.record["chunks"]
        if not isinstance(chunks, list):
            raise self.bad("chunks", "not a list")
        if len(chunks) != chunk_count(size_bytes, chunk_size):
            raise self.bad("chunks", f"{len(chunks)} chunks for {size_bytes} bytes "
                           f"('size_bytes') in chunks of {chunk_size} ('chunk_size')")  # fmt: skip
        for i, chunk in enumerate(chunks):
            if chunk is not None and not (isinstance(chunk, str) and is_chunk_hex(chunk)):
                raise self.bad("chunks", f"chunk {i} is neither null nor 64 lowercase hex digits")
        return tuple(chunks)


def _record(text: bytes | str, code: Code, what: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FeosError(code, f"{what}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise FeosError(code, f"{what}: not a JSON object")
    return record


def _checked_manifest(record: dict[str, Any], code: Code) -> LayerManifest:
    fields = _Fields(record, code, "layer manifest")
    fields.strict(f.name for f in attrs.fields(LayerManifest))
    size_bytes = fields.number("size_bytes", 0)
    chunk_size = fields.number("chunk_size", 4096, _MAX_CHUNK_SIZE)
    manifest = LayerManifest(
        digest=fields.text("digest", _DIGEST, empty=False),
        parent=fields.text("parent", _DIGEST),
        size_bytes=size_bytes,
        virtual_bytes=fields.number("virtual_bytes", 0),
        guest=fields.text("guest"),
        image=fields.text("image"),
        format=fields.text("format"),
        chunk_size=chunk_size,
        chunks=fields.chunks(size_bytes, chunk_size),
        created_unix_ns=fields.number("created_unix_ns", 0),
    )
    if manifest.format not in _FORMATS:
        raise fields.bad("format", f"{manifest.format!r} is not one of {', '.join(_FORMATS)}")
    return manifest


@attrs.frozen
class MemoryManifest:
    """A memory snapshot as the store keeps it: the file's digest, size and chunks in order
    (None: a chunk of zeroes, not stored)."""

    digest: str
    size_bytes: int
    chunk_size: int = CHUNK_SIZE
    chunks: tuple[str | None, ...] = ()
    created_unix_ns: int = 0

    @property
    def what(self) -> str:
        return f"memory {self.digest}"

    def to_json(self) -> bytes:
        record = attrs.asdict(self)
        record["chunks"] = list(self.chunks)
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, text: bytes | str, code: Code = Code.DATA_LOSS) -> MemoryManifest:
        fields = _Fields(_record(text, code, "memory manifest"), code, "memory manifest")
        fields.strict(f.name for f in attrs.fields(cls))
        size_bytes = fields.number("size_bytes", 0)
        chunk_size = fields.number("chunk_size", 4096, _MAX_CHUNK_SIZE)
        return cls(
            digest=fields.text("digest", _DIGEST, empty=False),
            size_bytes=size_bytes,
            chunk_size=chunk_size,
            chunks=fields.chunks(size_bytes, chunk_size),
            created_unix_ns=fields.number("created_unix_ns", 0),
        )

    def chunk_at(self, offset: int) -> tuple[int, str | None]:
        """The index of the chunk holding byte `offset` of the file, and its hex."""
        index = offset // self.chunk_size
        return index, self.chunks[index]


# -- the store -------------------------------------------------------------------------------


class StoreFailure(Exception):
    """One failed request: the store's own words, and whether another try may change them."""

    def __init__(self, message: str, retryable: bool, absent: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.absent = absent  # the key is not there (and the bucket is)


def _failure(exc: Exception) -> StoreFailure:
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(error.get("Code", status))
        message = f"{code}: {error.get('Message') or 'HTTP ' + str(status)}"
        retryable = status >= 500 or status in (408, 429) or code in _RETRYABLE_CODES
        return StoreFailure(message, retryable, absent=code in _ABSENT_CODES)
    retryable = not isinstance(exc, botocore.exceptions.NoCredentialsError)
    return StoreFailure(f"{type(exc).__name__}: {exc}", retryable)


class ObjectStore:
    """Layers to and from one bucket; every method blocks."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id or None,
            aws_secret_access_key=config.secret_access_key or None,
            aws_session_token=config.session_token or None,
            region_name=config.region,
        )
        self._s3: Any = session.client(
            "s3",
            endpoint_url=config.endpoint or None,
            config=botocore.config.Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"total_max_attempts": 1},  # ours: _call
                max_pool_connections=max(10, 2 * config.concurrency),
                # an endpoint of our own (moto, MinIO, Ceph) rarely has per-bucket host names
                s3={"addressing_style": "path" if config.endpoint else "auto"},
            ),
        )
        where = f" at {config.endpoint}" if config.endpoint else ""
        self._where = f"the object store (bucket {config.bucket}{where})"

    def chunk_key(self, hex_: str) -> str:
        return f"{self.config.prefix}chunks/{hex_}"

    def manifest_key(self, digest: str) -> str:
        return f"{self.config.prefix}layers/{digest_hex(digest)}.json"

    def memory_key(self, digest: str) -> str:
        return f"{self.config.prefix}memory/{digest_hex(digest)}.json"

    # -- requests, each with its tries

    def _call(self, what: str, request: Callable[[], T]) -> T:
        """request() until it succeeds, fails for good or has had its tries; StoreFailure."""
        for attempt in range(self.config.tries):
            try:
                return request()
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                failure = _failure(exc)
            if not failure.retryable or attempt + 1 == self.config.tries:
                raise failure
            log.info("%s: %s: %s (try %d of %d)", self._where, what, failure.message,
                     attempt + 1, self.config.tries)  # fmt: skip
            time.sleep(self.config.retry_delay_s * 2**attempt)
        raise AssertionError("unreachable")

    def _unavailable(self, what: str, failure: StoreFailure) -> FeosError:
        tries = f" (after {self.config.tries} tries)" if failure.retryable else ""
        return FeosError(Code.UNAVAILABLE, f"{self._where}: {what}: {failure.message}{tries}")

    def _get(self, key: str, limit: int) -> bytes | None:
        """The object's bytes, None when the bucket has no such key; StoreFailure. Of an object
        larger than `limit`, limit + 1 bytes: too many for what the caller expects."""

        def get() -> bytes:
            answer = self._s3.get_object(Bucket=self.config.bucket, Key=key)
            with answer["Body"] as body:
                data: bytes = body.read(limit + 1)
            return data

        try:
            return self._call(f"GET {key}", get)
        except StoreFailure as failure:
            if failure.absent:
                return None
            raise

    def _has(self, key: str) -> bool:
        bucket = self.config.bucket
        try:
            self._call(f"HEAD {key}", lambda: self._s3.head_object(Bucket=bucket, Key=key))
        except StoreFailure as failure:
            if failure.absent:  # or the bucket is missing: the PUT that follows says so
                return False
            raise
        return True

    def _put(self, key: str, data: bytes) -> None:
        """PUT with the body's sha256: the store refuses a body that changed on the way."""
        checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
        bucket = self.config.bucket
        self._call(f"PUT {key}", lambda: self._s3.put_object(
            Bucket=bucket, Key=key, Body=data, ChecksumSHA256=checksum))  # fmt: skip

    def close(self) -> None:
        """Close the client's connections."""
        self._s3.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- manifests

    def get_manifest(self, digest: str) -> LayerManifest:
        """The layer's manifest; NOT_FOUND when the store has none, DATA_LOSS when it is bad."""
        key = self.manifest_key(digest)
        return self._manifest(key, digest, f"layer {digest}", LayerManifest.from_json)

    def get_memory(self, digest: str) -> MemoryManifest:
        """A memory snapshot's manifest; NOT_FOUND when the store has none, DATA_LOSS when it
        is bad."""
        key = self.memory_key(digest)
        return self._manifest(key, digest, f"memory snapshot {digest}", MemoryManifest.from_json)

    def _manifest(self, key: str, digest: str, what: str, parse: Callable[[bytes], M]) -> M:
        data = self._request(f"manifest {key}", lambda: self._get(key, _MAX_MANIFEST))
        if data is None:
            raise FeosError(Code.NOT_FOUND, f"{self._where} has no {what}")
        if len(data) > _MAX_MANIFEST:
            raise FeosError(Code.DATA_LOSS, f"{self._where}: {key} is larger than a manifest "
                            f"can be ({_MAX_MANIFEST} bytes)")  # fmt: skip
        try:
            manifest = parse(data)
        except FeosError as exc:
            raise FeosError(Code.DATA_LOSS, f"{self._where}: {key}: {exc.message}") from None
        if manifest.digest != digest:
            raise FeosError(Code.DATA_LOSS, f"{self._where}: {key} describes {manifest.digest}")
        return manifest

    def has_layer(self, digest: str) -> bool:
        try:
            self.get_manifest(digest)
        except FeosError as exc:
            if exc.code == Code.NOT_FOUND:
                return False
            raise
        return True

    # -- checkpoints (feosd's hibernations: a small JSON object under its own digest)

    def checkpoint_key(self, ref: str) -> str:
        return f"{self.config.prefix}checkpoints/{digest_hex(ref, 'ref')}.json"

    def put_checkpoint(self, body: bytes) -> str:
        """The checkpoint's description into the store; its reference, "sha256:<hex>"."""
        if len(body) > _MAX_CHECKPOINT:
            raise FeosError(Code.INVALID_ARGUMENT, f"a checkpoint is at most {_MAX_CHECKPOINT} "
                            f"bytes, not {len(body)}")  # fmt: skip
        ref = f"sha256:{hashlib.sha256(body).hexdigest()}"
        key = self.checkpoint_key(ref)
        self._request(f"checkpoint {key}", lambda: self._put(key, body))
        return ref

    def get_checkpoint(self, ref: str) -> bytes:
        """NOT_FOUND: the store has none; DATA_LOSS: its bytes are not `ref`'s."""
        key = self.checkpoint_key(ref)
        data = self._request(f"checkpoint {key}", lambda: self._get(key, _MAX_CHECKPOINT))
        if data is None:
            raise FeosError(Code.NOT_FOUND, f"{self._where} has no checkpoint {ref}")
        if f"sha256:{hashlib.sha256(data).hexdigest()}" != ref:
            raise FeosError(Code.DATA_LOSS, f"{self._where}: {key} is not checkpoint {ref}: "
                            "its digest does not match")  # fmt: skip
        return data

    # -- push

    def push_layer(
        self, layer_path: Path, manifest: LayerManifest, stop: threading.Event | None = None
    ) -> LayerManifest:
        """Upload the layer file's chunks the store lacks, then its manifest (returned, with
        size_bytes, chunk_size and chunks filled in). DATA_LOSS: the file is not `digest`;
        ABORTED: `stop` was set (no manifest is put then; the requests in flight end first)."""
        key = self.manifest_key(manifest.digest)
        # first, and with a GET: an error's body has the store's words (a HEAD's has none)
        there = self._request(f"manifest {key}", lambda: self._get(key, _MAX_MANIFEST))
        pushed = _PushedChunks()
        size, whole, chunks = self._push_file(
            layer_path, f"layer file {layer_path}", pushed, stop, f"push of {manifest.digest}")
        if f"sha256:{whole}" != manifest.digest:
            raise FeosError(Code.DATA_LOSS, f"layer file {layer_path} is sha256:{whole}, "
                            f"not {manifest.digest}")  # fmt: skip
        done = attrs.evolve(manifest, size_bytes=size, chunk_size=CHUNK_SIZE, chunks=tuple(chunks))
        if there is None or not _same_layer(there, done):
            self._request(f"manifest {key}", lambda: self._put(key, done.to_json()))
        log.info("%s: pushed %s: %d chunks, %d uploaded (%d bytes)", self._where, done.digest,
                 len(chunks), pushed.count, pushed.bytes)  # fmt: skip
        return done

    def push_memory(
        self, path: Path, stop: threading.Event | None = None, progress: Progress | None = None
    ) -> MemoryManifest:
        """Upload a memory snapshot file's chunks the store lacks (chunks of zeroes are not
        stored), then its manifest under the file's digest (returned). ABORTED: `stop` was set
        before the manifest was put (none is put then)."""
        pushed = _PushedChunks()
        size, whole, chunks = self._push_file(path, f"memory snapshot {path}", pushed, stop,
                                              f"push of memory {path}", progress)  # fmt: skip
        if stop is not None and stop.is_set():
            raise FeosError(Code.ABORTED, f"push of memory {path}: stopped by its caller")
        manifest = MemoryManifest(digest=f"sha256:{whole}", size_bytes=size, chunks=tuple(chunks),
                                  created_unix_ns=time.time_ns())  # fmt: skip
        key = self.memory_key(manifest.digest)
        self._request(f"manifest {key}", lambda: self._put(key, manifest.to_json()))
        log.info("%s: pushed %s: %d chunks, %d uploaded (%d bytes)", self._where,
                 manifest.what, len(chunks), pushed.count, pushed.bytes)  # fmt: skip
        return manifest

    def _push_file(
        self,
        path: Path,
        name: str,
        pushed: _PushedChunks,
        stop: threading.Event | None,
        what: str,
        progress: Progress | None = None,
    ) -> tuple[int, str, list[str | None]]:
        """The file's chunks pushed: (its size, its sha256 hex, its chunks)."""
        with os_errors(name):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if progress is not None:
                    progress.start(size)
                whole, chunks = self._push_chunks(fd, size, pushed, stop, what, progress)
            finally:
                os.close(fd)
        return size, whole, chunks

    def _push_chunks(
        self,
        fd: int,
        size: int,
        pushed: _PushedChunks,
        stop: threading.Event | None,
        what: str,
        progress: Progress | None,
    ) -> tuple[str, list[str | None]]:
        """The file read in order and hashed whole, its new chunks uploaded on the pool: (the
        whole file's sha256 hex, the chunks). Progress counts a hole or a chunk seen before
        when it is read, a new chunk when the store has it."""
        done = progress.add if progress is not None else (lambda _: None)
        whole = hashlib.sha256()
        chunks: list[str | None] = []
        seen: set[str] = set()

        def new_chunks() -> Iterator[tuple[str, bytes]]:
            for chunk in read_chunks(fd, size, CHUNK_SIZE):
                if chunk.data is None:
                    whole.update(zeroes(chunk.length))
                    chunks.append(None)
                    done(chunk.length)
                    continue
                whole.update(chunk.data)
                hex_ = chunk_hex(chunk.data)
                chunks.append(hex_)
                if hex_ in seen:
                    done(chunk.length)
                else:
                    seen.add(hex_)
                    yield hex_, chunk.data

        uploads = self._ordered(lambda item: self._push_chunk(*item, pushed), new_chunks(),
                                stop, what)  # fmt: skip
        for length in uploads:
            done(length)
        return whole.hexdigest(), chunks

    def _push_chunk(self, hex_: str, data: bytes, pushed: _PushedChunks) -> int:
        """The chunk into the store unless it is there: its length."""
        key = self.chunk_key(hex_)
        if self._request(f"chunk {hex_}", lambda: self._has(key)):
            return len(data)
        self._request(f"chunk {hex_}", lambda: self._put(key, data))
        pushed.add(len(data))
        return len(data)

    def _request(self, what: str, request: Callable[[], T]) -> T:
        """request(), its StoreFailure told as UNAVAILABLE with the store's words."""
        try:
            return request()
        except StoreFailure as failure:
            raise self._unavailable(what, failure) from None

    # -- pull

    def pull_layer(
        self,
        digest: str,
        cache: ChunkCache,
        dest_dir: Path,
        name: str | None = None,
        stop: threading.Event | None = None,
    ) -> LayerManifest:
        """The layer from the store into dest_dir/<name> (layer_file_name by default), made of
        chunks from the cache or the store, each checked; sparse, fsynced, 0444, whole or not
        at all. DATA_LOSS: a chunk that stays wrong after its tries, or a layer whose assembled
        file is not `digest`; ABORTED: `stop` was set."""
        name = name or layer_file_name(digest)
        if "/" in name or name.startswith(".") or not name:
            raise FeosError(Code.INVALID_ARGUMENT, f"layer file name {name!r}: not a plain name")
        manifest = self.get_manifest(digest)
        self._pull_into(manifest, cache, dest_dir / name, stop, None, 0o444, -1)
        return manifest

    def pull_memory(
        self,
        digest: str,
        cache: ChunkCache,
        dest: Path,
        stop: threading.Event | None = None,
        progress: Progress | None = None,
        owner_uid: int = -1,
    ) -> MemoryManifest:
        """A memory snapshot from the store into the file `dest` (0600, owned by `owner_uid`
        when it is not -1), as pull_layer assembles a layer: every chunk checked, the file
        whole or not at all. NOT_FOUND: the store has no such snapshot."""
        manifest = self.get_memory(digest)
        if progress is not None:
            progress.start(manifest.size_bytes)
        self._pull_into(manifest, cache, dest, stop, progress, 0o600, owner_uid)
        return manifest

    def memory_chunk(self, manifest: MemoryManifest, index: int, cache: ChunkCache) -> bytes | None:
        """Chunk `index` of a memory snapshot, checked: from the cache, else fetched into it
        (None: a chunk of zeroes). Blocks; DATA_LOSS or UNAVAILABLE as a pull."""
        hex_ = manifest.chunks[index]
        if hex_ is None:
            return None
        data = cache.read(hex_)
        return data if data is not None else self._fetch_into(cache, hex_, manifest)

    def _pull_into(
        self,
        manifest: Manifest,
        cache: ChunkCache,
        dest: Path,
        stop: threading.Event | None,
        progress: Progress | None,
        mode: int,
        owner_uid: int,
    ) -> None:
        owner = f"pull {manifest.digest} {uuid.uuid4()}"
        cache.pin(owner, (h for h in manifest.chunks if h is not None))
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with os_errors(f"{manifest.what} into {dest.parent}"):
                self._assemble(manifest, cache, tmp, stop, progress, mode, owner_uid)
                os.rename(tmp, dest)
                fsync_dir(dest.parent)
        except BaseException:
            unlink_quietly(tmp)
            raise
        finally:
            cache.unpin(owner)

    def _assemble(
        self,
        manifest: Manifest,
        cache: ChunkCache,
        tmp: Path,
        stop: threading.Event | None,
        progress: Progress | None,
        mode: int,
        owner_uid: int,
    ) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, manifest.size_bytes)
            flights = _Flights()
            what = f"pull of {manifest.what}"
            fetched = self._ordered(lambda h: self._chunk(h, cache, manifest, flights),
                                    manifest.chunks, stop, what)  # fmt: skip
            with contextlib.closing(fetched):  # a failure here ends the fetches now
                self._write_chunks(fd, manifest, fetched, progress)
            if owner_uid != -1:
                os.fchown(fd, owner_uid, -1)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_chunks(
        self,
        fd: int,
        manifest: Manifest,
        fetched: Iterable[bytes | None],
        progress: Progress | None,
    ) -> None:
        whole = hashlib.sha256()
        for i, data in enumerate(fetched):
            length = min(manifest.chunk_size, manifest.size_bytes - i * manifest.chunk_size)
            if data is None:
                whole.update(zeroes(length))
            else:
                whole.update(data)
                pwrite_all(fd, data, i * manifest.chunk_size)
            if progress is not None:
                progress.add(length)
        if f"sha256:{whole.hexdigest()}" != manifest.digest:
            raise FeosError(Code.DATA_LOSS, f"{manifest.what} assembled from its "
                            f"chunks is sha256:{whole.hexdigest()}")  # fmt: skip

    def _chunk(
        self, hex_: str | None, cache: ChunkCache, manifest: Manifest, flights: _Flights
    ) -> bytes | None:
        """A chunk's verified bytes: the cache's, else fetched (and then cached). A chunk that
        comes again in the layer waits for its first fetch and is read from the cache."""
        if hex_ is None:
            return None
        first, flight = flights.join(hex_)
        if not first:
            flight.result()  # the first one's failure is this one's too
            data = cache.read(hex_)  # pinned: still there, but for a damage since
            return data if data is not None else self._fetch_into(cache, hex_, manifest)
        try:
            data = cache.read(hex_)
            if data is None:
                data = self._fetch_into(cache, hex_, manifest)
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        flight.set_result(None)
        return data

    def _fetch_into(self, cache: ChunkCache, hex_: str, manifest: Manifest) -> bytes:
        data = self._fetch_chunk(hex_, manifest)
        cache.put(hex_, data)
        return data

    def _fetch_chunk(self, hex_: str, manifest: Manifest) -> bytes:
        """The chunk from the store, refused and fetched again while its bytes do not match."""
        key = self.chunk_key(hex_)
        for attempt in range(self.config.tries):
            try:
                data = self._get(key, manifest.chunk_size)  # more cannot match
            except StoreFailure as failure:
                what = f"chunk {hex_} of {manifest.what}"
                raise self._unavailable(what, failure) from None
            if data is None:
                raise FeosError(Code.DATA_LOSS, f"{self._where}: chunk {hex_} of "
                                f"{manifest.what} is missing ({key})")  # fmt: skip
            if chunk_hex(data) == hex_:
                return data
            log.warning("%s: chunk %s came with sha256 %s: refused (try %d of %d)", self._where,
                        hex_, chunk_hex(data), attempt + 1, self.config.tries)  # fmt: skip
            if attempt + 1 < self.config.tries:
                time.sleep(self.config.retry_delay_s * 2**attempt)
        raise FeosError(Code.DATA_LOSS, f"{self._where}: chunk {hex_} of "
                        f"{manifest.what} does not match its digest after "
                        f"{self.config.tries} tries: refused")  # fmt: skip

    def _ordered(
        self, work: Callable[[T], R], items: Iterable[T], stop: threading.Event | None, what: str
    ) -> Generator[R]:
        """work(item) on a pool, `concurrency` in flight, the results in the items' order; the
        first failure, or `stop` set (ABORTED), cancels what has not begun and is raised once
        what runs has ended."""
        window = self.config.concurrency
        with concurrent.futures.ThreadPoolExecutor(window, thread_name_prefix="objstore") as pool:
            pending: collections.deque[concurrent.futures.Future[R]] = collections.deque()
            try:
                for item in items:
                    if stop is not None and stop.is_set():
                        raise FeosError(Code.ABORTED, f"{what}: stopped by its caller")
                    pending.append(pool.submit(work, item))
                    if len(pending) >= window:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()


_ERRNO_CODES = {
    errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
    errno.EDQUOT: Code.RESOURCE_EXHAUSTED,
    errno.ENOENT: Code.NOT_FOUND,
    errno.EACCES: Code.PERMISSION_DENIED,
    errno.EPERM: Code.PERMISSION_DENIED,
    errno.EROFS: Code.FAILED_PRECONDITION,
}


@contextlib.contextmanager
def os_errors(what: str) -> Iterator[None]:
    """An OSError of the node's files as a FeosError naming `what` (ENOSPC: RESOURCE_EXHAUSTED)."""
    try:
        yield
    except OSError as exc:
        code = _ERRNO_CODES.get(exc.errno or 0, Code.INTERNAL)
        raise FeosError(code, f"{what}: {exc.strerror or exc}") from exc


class _Flights:
    """The fetches of one pull by chunk: the first of a chunk fetches, the others wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, concurrent.futures.Future[None]] = {}

    def join(self, hex_: str) -> tuple[bool, concurrent.futures.Future[None]]:
        """(True, its future) for the first of `hex_`, which must settle it; (False, it) after."""
        with self._lock:
            flight = self._flights.get(hex_)
            if flight is not None:
                return False, flight
            flight = self._flights[hex_] = concurrent.futures.Future()
            return True, flight


@attrs.define
class Progress:
    """One transfer's bytes done of its total: written by its threads, read by anyone."""

    total: int = 0
    done: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def start(self, total: int) -> None:
        with self._lock:
            self.total, self.done = total, 0

    def add(self, size: int) -> None:
        with self._lock:
            self.done += size


@attrs.define
class _PushedChunks:
    """What one push uploaded, counted from its pool's threads."""

    count: int = 0
    bytes: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def add(self, size: int) -> None:
        with self._lock:
            self.count += 1
            self.bytes += size


def _same_layer(there: bytes, manifest: LayerManifest) -> bool:
    """The store's manifest says what this one says (but when it was made)."""
    try:
        kept = LayerManifest.from_json(there)
    except FeosError:
        return False  # a damaged one is replaced
    return attrs.evolve(kept, created_unix_ns=manifest.created_unix_ns) == manifest


Manifest = LayerManifest | MemoryManifest
"""What a pull assembles: a layer or a memory snapshot."""
