"""The layer manifest's JSON: round trips, strict parsing, and garbage that never escapes as
anything but a FeosError naming what is wrong; the store's configuration from the environment."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.disk._chunks import CHUNK_SIZE, chunk_count
from feos.disk._objstore import (
    LayerManifest,
    StoreConfig,
    add_store_options,
    digest_hex,
    layer_file_name,
)
from feos.errors import Code, FeosError

HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
DIGEST = HEX.map(lambda h: f"sha256:{h}")
TEXT = st.text(max_size=40)


@st.composite
def manifests(draw: st.DrawFn) -> LayerManifest:
    chunk_size = draw(st.sampled_from([4096, 65536, CHUNK_SIZE]))
    size = draw(st.integers(0, 40 * chunk_size))
    chunks = draw(st.lists(st.none() | HEX, min_size=chunk_count(size, chunk_size),
                           max_size=chunk_count(size, chunk_size)))  # fmt: skip
    return LayerManifest(
        digest=draw(DIGEST),
        parent=draw(st.just("") | DIGEST),
        size_bytes=size,
        virtual_bytes=draw(st.integers(0, 2**63 - 1)),
        guest=draw(TEXT),
        image=draw(TEXT),
        format=draw(st.sampled_from(["qcow2", "raw"])),
        chunk_size=chunk_size,
        chunks=tuple(chunks),
        created_unix_ns=draw(st.integers(0, 2**63 - 1)),
    )


def record(manifest: LayerManifest) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(manifest.to_json())
    return data


def parse_error(data: object) -> FeosError:
    with pytest.raises(FeosError) as caught:
        LayerManifest.from_json(json.dumps(data))
    return caught.value


@given(manifests())
def test_round_trip(manifest: LayerManifest) -> None:
    assert LayerManifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_json() == LayerManifest.from_json(manifest.to_json()).to_json()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@given(st.binary(max_size=300))
def test_garbage_bytes_are_data_loss(data: bytes) -> None:
    try:
        LayerManifest.from_json(data)
    except FeosError as exc:
        assert exc.code == Code.DATA_LOSS
        assert exc.message.startswith("layer manifest")


@given(JSON)
def test_garbage_json_is_refused(data: object) -> None:
    assert parse_error(data).code == Code.DATA_LOSS


@given(manifests(), st.sampled_from([f for f in LayerManifest.__attrs_attrs__]), JSON)
def test_a_field_replaced_by_garbage_is_named(manifest: LayerManifest, field: Any,
                                              value: object) -> None:  # fmt: skip
    data = record(manifest)
    data[field.name] = value
    try:
        parsed = LayerManifest.from_json(json.dumps(data))
    except FeosError as exc:
        assert exc.code == Code.DATA_LOSS
        assert repr(field.name) in exc.message
    else:  # garbage that happens to be valid (a string where a string goes)
        assert record(parsed) == data


@given(manifests(), st.data())
def test_a_field_missing_or_extra_is_named(manifest: LayerManifest, data: st.DataObject) -> None:
    fields = record(manifest)
    gone = data.draw(st.sampled_from(sorted(fields)))
    del fields[gone]
    assert repr(gone) in parse_error(fields).message
    fields = record(manifest) | {"colour": "blue"}
    assert "'colour'" in parse_error(fields).message


@given(manifests())
def test_a_mutated_manifest_never_escapes(manifest: LayerManifest) -> None:
    text = manifest.to_json()
    for i in range(0, len(text), max(1, len(text) // 50)):
        for patch in (b"", b"x", b"{", b"\xff", b"9"):
            try:
                LayerManifest.from_json(text[:i] + patch + text[i + 1 :])
            except FeosError as exc:
                assert exc.code == Code.DATA_LOSS


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("digest", "sha256:abc", "is not sha256:<64 hex>"),
        ("digest", "", "is not sha256:<64 hex>"),
        ("parent", "md5:" + "0" * 64, "is not sha256:<64 hex>"),
        ("size_bytes", -1, "not an integer from 0"),
        ("size_bytes", True, "not an integer"),
        ("size_bytes", 1.5, "not an integer"),
        ("chunk_size", 0, "not an integer from 4096"),
        ("format", "vmdk", "'vmdk' is not one of qcow2, raw"),
        ("chunks", "none", "not a list"),
        ("chunks", [None, None], "2 chunks for"),
        ("chunks", ["A" * 64], "chunk 0 is neither null nor 64 lowercase hex"),
        ("created_unix_ns", 2**63, "not an integer"),
    ],
)
def test_bad_fields(field: str, value: object, says: str) -> None:
    manifest = LayerManifest(digest="sha256:" + "1" * 64, parent="", size_bytes=10,
                             virtual_bytes=10, guest="g", image="", format="raw",
                             chunks=("2" * 64,))  # fmt: skip
    error = parse_error(record(manifest) | {field: value})
    assert error.code == Code.DATA_LOSS
    assert f"field {field!r}" in error.message and says in error.message


def test_the_code_is_the_callers() -> None:
    with pytest.raises(FeosError) as caught:
        LayerManifest.from_json("[]", code=Code.INVALID_ARGUMENT)
    assert caught.value.code == Code.INVALID_ARGUMENT


def test_digests_and_file_names() -> None:
    assert digest_hex("sha256:" + "a" * 64) == "a" * 64
    assert layer_file_name("sha256:" + "a" * 64) == "sha256-" + "a" * 64
    for bad in ("a" * 64, "sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha256:../x"):
        with pytest.raises(FeosError) as caught:
            layer_file_name(bad)
        assert caught.value.code == Code.INVALID_ARGUMENT and "digest" in caught.value.message


# -- the store's configuration


def test_no_bucket_is_no_store_with_a_reason() -> None:
    config, reason = StoreConfig.from_env({"AWS_ACCESS_KEY_ID": "k"})
    assert config is None and "S3_BUCKET" in reason


def test_the_environment_as_etc_default_diskd_holds_it() -> None:
    env = {"S3_BUCKET": "layers", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000/",
           "AWS_DEFAULT_REGION": "eu-central-1", "AWS_ACCESS_KEY_ID": "key",
           "AWS_SECRET_ACCESS_KEY": "secret", "S3_PREFIX": "/node-7/"}  # fmt: skip
    config, reason = StoreConfig.from_env(env)
    assert reason == "" and config is not None
    assert (config.bucket, config.endpoint, config.region, config.prefix) == (
        "layers", "http://127.0.0.1:9000", "eu-central-1", "node-7/")
    assert (config.access_key_id, config.secret_access_key) == ("key", "secret")
    assert "secret" not in repr(config)


def test_options_win_over_the_environment() -> None:
    parser = argparse.ArgumentParser()
    add_store_options(parser)
    options = parser.parse_args(["--s3-bucket", "other", "--s3-endpoint", "https://s3.example",
                                 "--s3-region", "us-west-2"])  # fmt: skip
    env = {"S3_BUCKET": "layers", "AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "x"}
    config, _ = StoreConfig.from_env(env, options)
    assert config is not None
    assert (config.bucket, config.endpoint, config.region, config.prefix) == (
        "other", "https://s3.example", "us-west-2", "")
    config, _ = StoreConfig.from_env(env, parser.parse_args([]))
    assert config is not None and (config.bucket, config.region) == ("layers", "eu-west-1")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"S3_BUCKET": "no spaces"}, "S3_BUCKET"),
        ({"S3_BUCKET": "b" * 300}, "S3_BUCKET"),
        ({"S3_BUCKET": "ok-bucket", "AWS_ENDPOINT_URL": "127.0.0.1:9000"}, "AWS_ENDPOINT_URL"),
        ({"S3_BUCKET": "ok-bucket", "AWS_ENDPOINT_URL": "http://h/path"}, "AWS_ENDPOINT_URL"),
        ({"S3_BUCKET": "ok-bucket", "AWS_ACCESS_KEY_ID": "k"}, "AWS_SECRET_ACCESS_KEY"),
    ],
)
def test_a_malformed_setting_is_named(env: dict[str, str], says: str) -> None:
    with pytest.raises(FeosError) as caught:
        StoreConfig.from_env(env)
    assert caught.value.code == Code.INVALID_ARGUMENT and says in caught.value.message
