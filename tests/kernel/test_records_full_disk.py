"""The records on a full disk: a tmpfs of the test's own (unmounted after), filled by a file.

With no room for the journal a change fails, saying so; with the journal made and then the disk
full, the journal still takes changes (its blocks are there) while their files cannot be
written, until it is full: then a change fails RESOURCE_EXHAUSTED, and every change answered
before is there once the disk has room again.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import run
from feos import _schema
from feos.errors import Code, FeosError
from feos.records import RecordDir

VOLUME = _schema.volume().Volume


def fill(directory: Path) -> Path:
    """A file that takes every block left."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, bytes(4096))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return filler
    finally:
        os.close(fd)


async def puts_until_refused(records: RecordDir, acknowledged: dict[str, int]) -> None:
    for n in range(100_000):
        await records.put(f"v{n}", {"id": f"v{n}", "sizeBytes": n})
        acknowledged[f"v{n}"] = n


def sizes(loaded: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {k: v["sizeBytes"] for k, v in loaded.items()}


async def test_a_full_disk_fails_changes_clearly_and_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=4m", "feostest-records", str(disk))
    try:
        directory = disk / "volumes"
        directory.mkdir()
        filler = fill(disk)
        records = RecordDir(directory, VOLUME, journal_bytes=64 << 10)  # no room for it
        try:
            with pytest.raises(FeosError) as caught:
                await records.put("a", {"id": "a", "sizeBytes": 1})
        finally:
            records.close()
        assert caught.value.code is Code.UNAVAILABLE
        assert "record" in caught.value.message and "a.pb" in caught.value.message
        assert "No space left on device" in caught.value.message
        filler.unlink()

        acknowledged: dict[str, int] = {}
        records = RecordDir(directory, VOLUME, journal_bytes=16 << 10)
        try:
            await records.put("first", {"id": "first", "sizeBytes": 7})
            acknowledged["first"] = 7
            filler = fill(disk)
            with pytest.raises(FeosError) as caught:
                await puts_until_refused(records, acknowledged)
            assert sizes(records.load()) == acknowledged  # the journal's, over the files'
        finally:
            records.close()  # the folder cannot write them: the journal keeps them
        assert caught.value.code is Code.RESOURCE_EXHAUSTED
        assert "the journal is full" in caught.value.message
        assert "No space left on device" in caught.value.message
        assert len(acknowledged) > 50  # the journal took what the files could not

        filler.unlink()
        records = RecordDir(directory, VOLUME)
        try:
            assert sizes(records.load()) == acknowledged
        finally:
            records.close()
        assert {p.name for p in directory.glob("*.pb")} == {f"{k}.pb" for k in acknowledged}
    finally:
        run("umount", str(disk))
