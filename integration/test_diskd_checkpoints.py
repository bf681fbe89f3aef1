"""diskd's checkpoints with a real object store (moto_server on loopback): putCheckpoint answers
the reference of what it put, getCheckpoint gives the same bytes back, and refuses a reference
the store lacks (NOT_FOUND) or bytes that changed in the store (DATA_LOSS); abort of a layer
that no push is moving aborts nothing. No microVM."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from diskd_proc import DiskdProc
from moto_s3 import moto_s3

from feos.errors import Code, FeosError


def test_a_checkpoint_goes_in_and_comes_back_checked(tmp_path: Path) -> None:
    body = b'{"format":"feos-checkpoint/1","pod_id":"p1"}'
    with moto_s3(tmp_path) as s3, DiskdProc(tmp_path / "d", env=s3.env()).start() as diskd:
        ref = diskd.call("putCheckpoint", body=body)["ref"]
        assert ref == f"sha256:{hashlib.sha256(body).hexdigest()}"
        assert diskd.call("getCheckpoint", ref=ref)["body"] == body
        key = f"checkpoints/{ref.removeprefix('sha256:')}.json"
        assert s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read() == body

        with pytest.raises(FeosError) as caught:
            diskd.call("getCheckpoint", ref="sha256:" + "0" * 64)
        assert caught.value.code is Code.NOT_FOUND and "has no checkpoint" in caught.value.message
        s3.client().put_object(Bucket=s3.bucket, Key=key, Body=body + b" ")
        with pytest.raises(FeosError) as caught:
            diskd.call("getCheckpoint", ref=ref)
        assert caught.value.code is Code.DATA_LOSS and "does not match" in caught.value.message
        with pytest.raises(FeosError) as caught:
            diskd.call("getCheckpoint", ref="sha256:short")
        assert caught.value.code is Code.INVALID_ARGUMENT

        assert diskd.call("abort", digest=ref)["aborted"] == 0
