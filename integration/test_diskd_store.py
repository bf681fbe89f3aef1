"""diskd with a real object store (moto_server on loopback): a baked layer pushed by one diskd
and pulled by another, which makes a disk on it that reads what the first one baked; its L0
comes from the second node's own guest install, not from the store."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from diskd_proc import DiskdProc
from moto_s3 import moto_s3

from feos.errors import Code, FeosError

MIB = 1 << 20


def _guest(root: Path) -> Path:
    """A guest install whose blank data volume is a small image of the test's own."""
    raw = root / "blank.img"
    with open(raw, "wb") as f:
        f.write(b"L0 of the guest " * 4096)
        f.truncate(64 * MIB)
    guest = root / "guests" / "g1"
    guest.mkdir(parents=True)
    subprocess.run(["zstd", "-q", "--sparse", "-o", str(guest / "data.img.zst"), str(raw)],
                   check=True)
    (guest / "manifest.json").write_text(json.dumps({"version": "g1", "built": "1"}))
    return guest


def _rw(path: str, offset: int, data: bytes | None = None, size: int = 0) -> bytes:
    fd = os.open(path, os.O_RDWR)
    try:
        if data is not None:
            os.pwrite(fd, data, offset)
            os.fsync(fd)
            return b""
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def test_a_baked_layer_travels_through_the_store(tmp_path: Path) -> None:
    guest = _guest(tmp_path)
    with moto_s3(tmp_path) as s3:
        env = s3.env()
        guests = ("--guest-dir", str(guest.parent))
        with DiskdProc(tmp_path / "one", *guests, env=env).start() as one:
            info = one.call("info")["info"]
            assert info["store"]["configured"] and info["store"]["bucket"] == s3.bucket
            l0 = one.call("importLayer", path=str(guest / "data.img.zst"), guest="g1")["layer"]
            one.call("createDisk", id="baker", kind="pod", sizeBytes=0, base=l0["digest"])
            disk = one.call("startDisk", id="baker", vmm="firecracker", ownerUid=0)["disk"]
            _rw(disk["path"], 9 * MIB, b"baked image " * 1000)
            baked = one.call("bake", id="baker", image="example/app:1")["layer"]
            pushed = one.call("push", digest=baked["digest"])["layer"]
            assert pushed["pushed"] is True
            keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]]
            hexes = {k.rpartition("/")[2].removesuffix(".json") for k in keys if "layers/" in k}
            assert hexes == {baked["digest"].removeprefix("sha256:")}  # the L0 stays home
        with DiskdProc(tmp_path / "two", *guests, env=env).start() as two:
            pulled = two.call("pull", digest=baked["digest"])["layer"]
            assert pulled["parent"] == l0["digest"] and pulled["image"] == "example/app:1"
            layers = {x["digest"] for x in two.ctl_json("layers")}
            assert {baked["digest"], l0["digest"]} <= layers  # the L0 from the guest install
            two.call("createDisk", id="on-baked", kind="pod", sizeBytes=0, base=baked["digest"])
            disk = two.call("startDisk", id="on-baked", vmm="firecracker", ownerUid=0)["disk"]
            assert _rw(disk["path"], 9 * MIB, size=12000) == b"baked image " * 1000
            assert _rw(disk["path"], 0, size=16) == b"L0 of the guest "
            assert two.call("info")["info"]["cache"]["chunks"] > 0
            with pytest.raises(FeosError) as caught:
                two.call("pull", digest="sha256:" + "1" * 64)
            assert caught.value.code is Code.NOT_FOUND
            two.call("deleteDisk", id="on-baked")
