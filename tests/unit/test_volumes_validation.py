"""The volumes' rules at the API's edge, and claims all or none."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import capnp
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from feos import _schema
from feos._codec import structure_params
from feos.errors import Code, FeosError
from feos.pods._volumes import (
    MIB,
    CreateVolume,
    Label,
    VolumeService,
    check_labels,
    check_size,
    check_volume_id,
)
from feos.records import RecordDir, is_directory_fd
from feos.rpc import capnp_thread, serve


@given(st.uuids())
def test_lowercase_uuids_pass(value: uuid.UUID) -> None:
    assert check_volume_id(str(value)) == str(value)


@given(st.text(max_size=40))
def test_anything_else_is_refused_naming_the_field(text: str) -> None:
    try:
        uuid.UUID(text)
        is_canonical = str(uuid.UUID(text)) == text
    except ValueError:
        is_canonical = False
    if is_canonical:
        assert check_volume_id(text) == text
    else:
        with pytest.raises(FeosError, match="^INVALID_ARGUMENT: id: ") as caught:
            check_volume_id(text)
        assert caught.value.code is Code.INVALID_ARGUMENT


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_sizes_are_whole_mib_from_64_mib_to_16_tib(size: int) -> None:
    ok = 64 * MIB <= size <= 16 << 40 and size % MIB == 0
    if ok:
        assert check_size(size) == size
    else:
        with pytest.raises(FeosError, match="sizeBytes"):
            check_size(size)


def test_labels_are_sorted_and_checked() -> None:
    assert check_labels([Label("b", "2"), Label("a", "1")]) == (("a", "1"), ("b", "2"))
    with pytest.raises(FeosError, match=r"labels\[1\].key: a is given twice"):
        check_labels([Label("a"), Label("a")])
    with pytest.raises(FeosError, match=r"labels\[0\].value"):
        check_labels([Label("a", "x" * 257)])


VOLUME_ID = "0b7e5a52-3c47-4d1c-9a1e-1f0e6e0b6f3a"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"id": "nope", "sizeBytes": 64 * MIB}, "id: must be a lowercase UUID"),
        ({"id": VOLUME_ID, "sizeBytes": "64"}, "sizeBytes: invalid value for type"),
        ({"id": VOLUME_ID, "sizeBytes": 1}, "sizeBytes: must be from 64 MiB"),
        ({"id": VOLUME_ID, "sizeBytes": 64 * MIB, "labels": [{"key": "a"}, {"key": 3}]},
         r"labels\[1\]\.key: invalid value for type"),
        ({"id": VOLUME_ID, "sizeBytes": 64 * MIB, "labels": [{"key": "a"}, {"key": "a"}]},
         r"labels\[1\]\.key: a is given twice"),
    ],
)
def test_create_volume_params_are_structured_and_checked_once_at_the_edge(
    params: dict[str, object], message: str
) -> None:
    with pytest.raises(FeosError, match=f"^INVALID_ARGUMENT: {message}") as caught:
        structure_params(params, CreateVolume)
    assert caught.value.code is Code.INVALID_ARGUMENT
    call = structure_params({"id": VOLUME_ID, "sizeBytes": 64 * MIB,
                             "labels": [{"key": "b"}, {"key": "a", "value": "1"}]}, CreateVolume)
    assert call.label_pairs() == (("a", "1"), ("b", ""))


async def test_the_same_volume_created_at_once_is_kept_once(tmp_path: Path) -> None:
    service = VolumeService(tmp_path)
    service.load()
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(service.create_volume, {"id": VOLUME_ID, "sizeBytes": 64 * MIB})
        assert [v.id for v in service.store] == [VOLUME_ID]
        answer = service.get_volume({"id": VOLUME_ID})["volume"]
        assert answer.sizeBytes == 64 * MIB
        with pytest.raises(FeosError) as caught:
            await service.create_volume({"id": VOLUME_ID, "sizeBytes": 128 * MIB})
        assert caught.value.code is Code.ALREADY_EXISTS
    finally:
        service.close()


async def test_claims_are_all_or_none(tmp_path: Path) -> None:
    service = VolumeService(tmp_path)
    service.load()
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    try:
        for volume_id in (a, b):
            await service.create_volume({"id": volume_id, "sizeBytes": 64 * MIB})
        await service.claim("pod1", [a])
        # b is free but c does not exist, and a is another pod's: nothing is claimed.
        with pytest.raises(FeosError, match="not on this node"):
            await service.claim("pod2", [b, c])
        with pytest.raises(FeosError, match="attached to pod pod1"):
            await service.claim("pod2", [b, a])
        assert service.store.get(b).pod_id == ""  # type: ignore[union-attr]
        with pytest.raises(FeosError) as caught:
            await service.delete_volume({"id": a})
        assert caught.value.code is Code.FAILED_PRECONDITION
        await service.release("pod1")
        assert service.store.get(a).state == "available"  # type: ignore[union-attr]
        await service.delete_volume({"id": a})
    finally:
        service.close()


async def test_creates_on_the_capnp_thread_are_kept_and_answered_there(tmp_path: Path) -> None:
    """As the API runs them: on the Cap'n Proto thread, the memory changed there, no trip to
    trio; the same ID created at once is kept once, beside claims and deletes in trio."""
    service = VolumeService(tmp_path)
    service.load()
    where: list[str] = []
    answer = service.store._on_kept

    def recorded(volume_id: str, reader: Any) -> None:
        where.append(threading.current_thread().name)
        answer(volume_id, reader)

    service.store._on_kept = recorded
    others = [str(uuid.uuid4()) for _ in range(5)]
    try:
        await service.create_volume({"id": others[0], "sizeBytes": 64 * MIB})  # in trio
        async with capnp_thread() as bridge:

            async def creates() -> list[Any]:
                calls = [{"id": VOLUME_ID, "sizeBytes": 64 * MIB}] * 5
                calls += [{"id": v, "sizeBytes": 64 * MIB} for v in others[1:]]
                answers = await asyncio.gather(*(service.create_volume(c) for c in calls))
                return [a["volume"].id for a in answers]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.claim, "pod1", [others[0]])
                created = await bridge.call(creates)
            with pytest.raises(FeosError) as caught:
                await bridge.call(service.create_volume, {"id": VOLUME_ID, "sizeBytes": 128 * MIB})
            assert caught.value.code is Code.ALREADY_EXISTS
        assert created == [VOLUME_ID] * 5 + others[1:]
        assert sorted(v.id for v in service.store) == sorted([VOLUME_ID, *others])
        assert service.store.get(others[0]).pod_id == "pod1"  # type: ignore[union-attr]
        assert where.count("capnp") == 5  # VOLUME_ID once, and the other four
        assert where.count("MainThread") == 2  # the create in trio and the claim
        assert len(service.list_volumes({})["volumes"]) == 6
    finally:
        service.close()
    reloaded = VolumeService(tmp_path)
    reloaded.load()
    try:
        assert len(reloaded.list_volumes({})["volumes"]) == 6
    finally:
        reloaded.close()


async def test_ten_connections_creating_at_once_share_the_journal_sync(tmp_path: Path) -> None:
    """Through the API server, as feosctl calls it: ten connections' creates queued while the
    writer syncs an eleventh are one group, with one journal sync; the server serializes
    nothing."""
    syncs: list[str] = []
    hold, entered = threading.Event(), threading.Event()
    hold.set()

    def fsync(fd: int) -> None:
        kind = "dir" if is_directory_fd(fd) else "file"
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/.journal"):
            kind = "journal"  # the writer's: the folder's syncs are not held
            entered.set()
            hold.wait()
        syncs.append(kind)
        os.fsync(fd)

    records = RecordDir(tmp_path / "volumes", _schema.volume().Volume, fsync=fsync)
    service = VolumeService(tmp_path, records)
    service.load()
    ids = [str(uuid.uuid4()) for _ in range(11)]
    try:
        async with capnp_thread() as bridge:

            async def creates() -> list[str]:
                pairs = [socket.socketpair() for _ in range(11)]
                conns = []
                for a, b in pairs:
                    server = capnp.TwoPartyServer(
                        await capnp.AsyncIoStream.create_connection(sock=a),
                        bootstrap=serve(_schema.volume().VolumeService, service, bridge))
                    client = capnp.TwoPartyClient(
                        await capnp.AsyncIoStream.create_connection(sock=b))
                    conns.append((server, client, client.bootstrap().cast_as(
                        _schema.volume().VolumeService)))  # fmt: skip
                all_queued, submit_put, queued = asyncio.Event(), records.submit_put, []

                def counted(*args: Any) -> Any:
                    queued.append(submit_put(*args))
                    if len(queued) == 11:
                        all_queued.set()
                    return queued[-1]

                records.submit_put = counted  # type: ignore[method-assign]
                try:
                    entered.clear()
                    hold.clear()
                    first = asyncio.ensure_future(conns[0][2].createVolume(ids[0], 64 * MIB))
                    await asyncio.to_thread(entered.wait)  # the writer is in the first's sync
                    rest = [
                        asyncio.ensure_future(c.createVolume(i, 64 * MIB))
                        for (_, _, c), i in zip(conns[1:], ids[1:], strict=True)
                    ]
                    await asyncio.wait_for(all_queued.wait(), 30)  # the ten are queued
                    hold.set()
                    answers = await asyncio.gather(first, *rest)
                    return [str(a.status.code) + " " + a.volume.id for a in answers]
                finally:
                    hold.set()
                    for server, client, _ in conns:
                        client.close()
                        server.close()
                    for a, b in pairs:
                        a.close()
                        b.close()

            answered = await bridge.call(creates)
        assert answered == [f"ok {i}" for i in ids]
        assert syncs.count("journal") == 2  # the first's, and one for the ten behind it
    finally:
        hold.set()
        service.close()
