"""Record files: round trips, order, and what a crash or a broken file leaves."""

from __future__ import annotations

import os
from pathlib import Path

import trio
import trio.lowlevel
from hypothesis import given, settings
from hypothesis import strategies as st

from feos import _schema
from feos.records import RecordDir, write_whole

labels = st.lists(
    st.fixed_dictionaries({"key": st.text(min_size=1, max_size=20), "value": st.text(max_size=40)}),
    max_size=5,
)
volumes = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=40),
        "sizeBytes": st.integers(min_value=0, max_value=2**64 - 1),
        "labels": labels,
        "state": st.sampled_from(["available", "attached", "checkpointed"]),
        "podId": st.text(max_size=20),
        "formatted": st.booleans(),
        "createdUnixNs": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    }
)


@settings(max_examples=60, deadline=None)
@given(value=volumes)
def test_a_record_reads_back_as_written(tmp_path_factory, value) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("records")

    async def main() -> dict:  # type: ignore[type-arg]
        records = RecordDir(directory, _schema.volume().Volume)
        try:
            await records.put("one", value)
            return records.load()
        finally:
            records.close()

    loaded = trio.run(main)
    expected = {k: v for k, v in value.items() if not (k == "labels" and v == [])}
    assert {k: v for k, v in loaded["one"].items() if not (k == "labels" and v == [])} == expected


async def test_writes_land_in_their_order(tmp_path: Path) -> None:
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        async with trio.open_nursery() as nursery:
            for size in range(1, 51):
                # Queued in order from one task: the last one asked for is what stays.
                nursery.start_soon(records.put, "v", {"id": "v", "sizeBytes": size})
                await trio.lowlevel.checkpoint()
        assert records.load()["v"]["sizeBytes"] == 50
    finally:
        records.close()


async def test_remove_and_a_broken_record_set_aside(tmp_path: Path) -> None:
    records = RecordDir(tmp_path, _schema.volume().Volume)
    try:
        await records.put("a", {"id": "a"})
        await records.put("b", {"id": "b"})
        await records.remove("a")
        (tmp_path / "c.pb").write_bytes(b"\x01\x02")
        (tmp_path / ".d.pb.tmp").write_bytes(b"half a write")
        loaded = records.load()
        assert set(loaded) == {"b"}
        assert list(tmp_path.glob("c.pb.broken-*"))
        assert not (tmp_path / ".d.pb.tmp").exists()
    finally:
        records.close()


def test_a_failed_write_leaves_the_old_record(tmp_path: Path) -> None:
    path = tmp_path / "r.pb"
    write_whole(path, b"old")
    os.chmod(tmp_path, 0o500)
    try:
        if os.geteuid() == 0:
            # root writes anyway: make the temporary name a directory instead, so the open fails
            os.chmod(tmp_path, 0o700)
            (tmp_path / ".r.pb.tmp").mkdir()
        try:
            write_whole(path, b"new")
        except OSError:
            pass
        else:
            raise AssertionError("the write should have failed")
    finally:
        os.chmod(tmp_path, 0o700)
    assert path.read_bytes() == b"old"
