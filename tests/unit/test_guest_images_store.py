"""The guest's image store after a crash: nothing of a pull is synced, so a record or a blob that
a crash cut short must read as an image not pulled, and the next pull fetches what is missing.

A crash is played by what it can leave on ext4 (data=ordered: no size past the data written):
a blob shorter than its manifest says, a record cut off, a record with no blob under it. The
registry is test_guest_registry's (Debian's docker-registry on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import capnp
from test_guest_registry import Registry, busybox, registry  # noqa: F401 (fixtures)

from feos.guest._images import ImageStore
from feos.guest._validate import reference


def pull(store: ImageStore, ref: str) -> None:
    asyncio.run(capnp.run(store.pull(ref, None)))


def pulled(reg: Registry, tmp_path: Path) -> tuple[ImageStore, str, Any, Path]:
    """A store that pulled busybox: the store, the reference's text, the reference, its record."""
    store = ImageStore(str(tmp_path))
    text = f"{reg.host}/feos/busybox:1"
    pull(store, text)
    ref = reference("r", text)
    return store, text, ref, Path(store._ref_path(ref))


def test_a_blob_cut_short_is_an_image_not_pulled_and_pulled_again(
    registry: Registry, busybox: str, tmp_path: Path  # noqa: F811
) -> None:
    store, text, ref, _ = pulled(registry, tmp_path)
    image = store.find(ref)
    assert image is not None and image.digest == busybox
    layer = Path(store.blob_path(image.layers[0][0]))
    whole = layer.read_bytes()
    os.truncate(layer, len(whole) // 2)  # what a crash before the writeback can leave
    assert store.find(reference("r", text)) is None
    pull(store, text)
    assert layer.read_bytes() == whole  # fetched again (and its digest checked)
    again = store.find(reference("r", text))
    assert again is not None and again.digest == busybox
    rootfs = tmp_path / "rootfs"
    store.unpack(again, str(rootfs))
    assert (rootfs / "bin" / "busybox").stat().st_size > 100_000


def test_a_record_cut_short_or_without_its_blob_is_no_image(
    registry: Registry, busybox: str, tmp_path: Path  # noqa: F811
) -> None:
    store, text, ref, record = pulled(registry, tmp_path)
    kept = record.read_bytes()
    record.write_bytes(kept[: len(kept) // 3])
    assert store.find(ref) is None
    record.write_bytes(b"")
    assert store.find(ref) is None
    record.write_bytes(kept)
    layer = Path(store.blob_path(json.loads(kept)["layers"][0][0]))
    layer.unlink()
    assert store.find(ref) is None
    pull(store, text)
    assert store.find(ref) is not None


def test_a_record_of_an_older_agent_without_sizes_still_reads(
    registry: Registry, busybox: str, tmp_path: Path  # noqa: F811
) -> None:
    store, _text, ref, record = pulled(registry, tmp_path)
    data = json.loads(record.read_bytes())
    assert set(data["sizes"]) == {d for d, _ in data["layers"]}
    del data["sizes"]
    record.write_text(json.dumps(data))
    found = store.find(ref)
    assert found is not None and found.digest == busybox
