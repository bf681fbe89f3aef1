"""diskd's pure model: layer names, records, stacks, the size of a disk, what a collect takes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.disk._model import (
    EMPTY_DIGEST,
    Disk,
    Layer,
    collectable,
    disks_on,
    layer_file,
    size_for,
    stack,
)
from feos.errors import Code, FeosError


def d(n: int) -> str:
    return f"sha256:{n:064x}"


def layer(n: int, parent: int | None = None, guest: str = "") -> Layer:
    return Layer(d(n), d(parent) if parent is not None else "",
                 "raw" if parent is None else "qcow2", 10, 100, guest=guest)


def test_a_layer_file_is_named_by_its_digest_without_a_colon() -> None:
    assert layer_file(d(1)) == "sha256-" + "0" * 63 + "1"
    for bad in ("sha256:abc", "md5:" + "0" * 64, "sha256:" + "A" * 64, ""):
        with pytest.raises(FeosError) as caught:
            layer_file(bad)
        assert caught.value.code is Code.INVALID_ARGUMENT


def test_records_round_trip() -> None:
    one = Layer(d(2), d(1), "qcow2", 5, 7, guest="g", image="i", pushed=True, created_unix_ns=9)
    assert Layer.from_json(one.to_json()) == one
    disk = Disk("p1", "pod", 100, "top.qcow2", "qcow2", (d(2), d(1)), state="started",
                vmm="firecracker", owner_uid=7, data_path_pid=3)
    assert Disk.from_json({**disk.to_json(), "a newer field": 1}) == disk
    assert disk.base == d(2) and disk.exported and disk.served_format() == "raw"


def test_a_stack_runs_from_the_base_to_its_l0() -> None:
    layers = {x.digest: x for x in (layer(1), layer(2, 1), layer(3, 2))}
    assert stack(layers, d(3)) == (d(3), d(2), d(1))
    with pytest.raises(FeosError) as caught:
        stack(layers, d(9))
    assert caught.value.code is Code.NOT_FOUND
    broken = {x.digest: x for x in (layer(2, 1), layer(3, 2))}
    with pytest.raises(FeosError) as caught:
        stack(broken, d(3))
    assert caught.value.code is Code.NOT_FOUND and "beneath" in caught.value.message


def test_a_disk_is_never_smaller_than_its_base() -> None:
    assert size_for(layer(1), 0) == 100
    assert size_for(layer(1), 50) == 100
    assert size_for(layer(1), 500) == 500
    for bad in (-1, (16 << 40) + 1):
        with pytest.raises(FeosError):
            size_for(layer(1), bad)
    with pytest.raises(FeosError):
        size_for(Layer(EMPTY_DIGEST, "", "raw", 0, 0), 0)


def test_collect_keeps_what_disks_and_installed_guests_stand_on() -> None:
    layers = {x.digest: x for x in (layer(1, guest="old"), layer(2, 1), layer(3, 2),
                                    layer(4, guest="new"), layer(5, 4),
                                    Layer(EMPTY_DIGEST, "", "raw", 0, 0))}
    disk = Disk("p", "pod", 1, "top.qcow2", "qcow2", (d(5), d(4)))
    assert disks_on(layers, [disk])[d(4)] == 1
    assert collectable(layers, [disk], guests=["new"]) == [d(3), d(2), d(1)]
    assert collectable(layers, [disk], guests=["old", "new"]) == [d(3), d(2)]
    assert collectable(layers, [], guests=[]) == [d(3), d(5), d(2), d(4), d(1)]


@given(st.lists(st.integers(0, 20), min_size=1, max_size=20), st.sets(st.integers(1, 20)))
def test_collect_removes_children_before_parents_and_never_a_kept_stack(
        parents: list[int], used: set[int]) -> None:
    # layer i+1's parent is a layer below it (or none): a forest
    layers = {}
    for i, p in enumerate(parents, start=1):
        parent = p if 0 < p < i else None
        layers[d(i)] = layer(i, parent)
    disks = [Disk(f"x{u}", "pod", 1, "top.qcow2", "qcow2", stack(layers, d(u)))
             for u in used if d(u) in layers]
    removed = collectable(layers, disks, guests=[])
    kept = {x for disk in disks for x in disk.layers}
    assert not kept & set(removed)
    for i, digest in enumerate(removed):
        parent = layers[digest].parent
        assert parent not in removed[:i]  # a parent goes after its children
    left = set(layers) - set(removed)
    for digest in left:  # nothing left stands on a removed layer
        assert layers[digest].parent not in removed
