"""Hibernation and restore as the pod service runs them (feos.pods._hibernate), over fakes of the
microVMs, the volumes and diskd (whose object store is a dict here), under the autojump clock:
the phases and the commit point, a second call joining the first, a Resume abandoning it, or
waiting for it with no_abandon, the store refusing an upload, a stopped pod's disks alone,
RestorePod on another node, and the checkpoints refused (missing, not matching their digest)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _podfakes import P1, SPEC, FakeDiskd, FakeVms, FakeVolumes, Node, node, running_pod

from feos.errors import Code, FeosError
from feos.pods._volumes import ATTACHED, CHECKPOINTED, Volume
from feos.vmm import VmInfo, VmSpec, VmState

LAYER = "sha256:" + "1" * 64
MEMORY = "sha256:" + "2" * 64


class Bucket(dict[str, bytes]):
    """The object store both nodes' diskd share: checkpoints by reference, memory by digest."""


class StoreDiskd(FakeDiskd):
    def __init__(self, bucket: Bucket, snapshots: Path) -> None:
        super().__init__()
        self.bucket = bucket
        self.snapshots = snapshots
        self.held: dict[str, trio.Event] = {}
        self.reached: dict[str, trio.Event] = {}
        self.refuse: set[str] = set()
        self.aborted: list[str] = []

    def hold(self, method: str) -> None:
        self.held[method] = trio.Event()
        self.reached[method] = trio.Event()

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]:
        if method in self.reached:
            self.reached[method].set()
        if method in self.held:
            with trio.CancelScope() as scope:
                self.abort_scope = scope
                await self.held[method].wait()
            if scope.cancelled_caught:
                raise FeosError(Code.ABORTED, f"{method}: abandoned")
        if method in self.refuse:
            raise FeosError(Code.UNAVAILABLE, "the object store: PUT: AccessDenied")
        handler = getattr(self, "_" + method, None)
        if handler is None:
            return await super().call(method, wait=wait, **params)
        self.calls.append((method, str(params.get("id", params.get("digest", "")))))
        result: dict[str, Any] = handler(**params)
        return result

    def _bake(self, id: str, image: str) -> dict[str, Any]:
        return {"layer": {"digest": LAYER, "sizeBytes": 1 << 20}}

    def _push(self, digest: str) -> dict[str, Any]:
        self.bucket[digest] = b"layer"
        return {"layer": {"digest": digest}}

    def _pushMemory(self, id: str, path: str) -> dict[str, Any]:
        self.bucket[MEMORY] = Path(path).read_bytes()
        return {"memory": {"digest": MEMORY, "sizeBytes": len(self.bucket[MEMORY])}}

    def _memoryTransfer(self, id: str) -> dict[str, Any]:
        return {"transfer": {"id": id, "bytesDone": 0}}

    def _putCheckpoint(self, body: bytes) -> dict[str, Any]:
        ref = f"sha256:{hashlib.sha256(body).hexdigest()}"
        self.bucket[ref] = body
        return {"ref": ref}

    def _getCheckpoint(self, ref: str) -> dict[str, Any]:
        if ref not in self.bucket:
            raise FeosError(Code.NOT_FOUND, f"the object store has no checkpoint {ref}")
        body = self.bucket[ref]
        if f"sha256:{hashlib.sha256(body).hexdigest()}" != ref:
            raise FeosError(Code.DATA_LOSS, f"checkpoint {ref}: its digest does not match")
        return {"body": body}

    def _pull(self, digest: str) -> dict[str, Any]:
        if digest not in self.bucket:
            raise FeosError(Code.NOT_FOUND, f"the object store has no layer {digest}")
        return {"layer": {"digest": digest}}

    def _createDisk(self, id: str, kind: str, sizeBytes: int, base: str) -> dict[str, Any]:
        self.states[id] = "stopped"
        return {"disk": {"id": id, "base": base}}

    def _pullMemory(self, id: str, digest: str, path: str, ownerUid: int) -> dict[str, Any]:
        Path(path).write_bytes(self.bucket[digest])
        return {"memory": {"digest": digest}}

    def _abort(self, digest: str) -> dict[str, Any]:
        self.aborted.append(digest)
        self.abort_scope.cancel()
        return {"aborted": 1}

    def _abandonMemory(self, id: str) -> dict[str, Any]:
        self.aborted.append("memory")
        self.abort_scope.cancel()
        return {}


class SnapshotVms(FakeVms):
    """microVMs whose suspend writes a memory file, and which a restore makes SUSPENDED on one."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.restored: dict[str, bytes] = {}

    def snapshot_file(self, vm_id: str) -> Path:
        return self.root / f"{vm_id}.memory"

    def vmm_version(self, driver: str | None = None) -> str:
        return "fakevmm 1.0"

    async def suspend(self, vm_id: str, *, purge_guest: bool = True) -> VmInfo:
        self.snapshot_file(vm_id).write_bytes(b"the memory of " + vm_id.encode())
        return await super().suspend(vm_id, purge_guest=purge_guest)

    async def restore(self, vm_id: str, spec: VmSpec, *, guest_version: str, driver: str,
                      memory: Path) -> VmInfo:  # fmt: skip
        await self.at("restore")
        self.restored[vm_id] = memory.read_bytes()
        memory.unlink()
        return self._set(vm_id, VmState.SUSPENDED)


class CheckpointVolumes(FakeVolumes):
    async def checkpointed(self, pod_id: str, layers: dict[str, str]) -> None:
        for volume_id, layer in layers.items():
            volume = self.store.volumes[volume_id]
            self.store.volumes[volume_id] = attrs.evolve(volume, state=CHECKPOINTED,
                                                         checkpoint=layer)

    async def take_checkpointed(self, pod_id: str, volumes: Any) -> None:
        for volume in volumes:
            self.store.volumes[volume.id] = attrs.evolve(volume, state=CHECKPOINTED)

    async def forget_checkpointed(self, pod_id: str) -> None:
        self.store.volumes = {k: v for k, v in self.store.volumes.items()
                              if not (v.pod_id == pod_id and v.state == CHECKPOINTED)}

    async def opened(self, volume_id: str) -> None:
        volume = self.store.volumes[volume_id]
        self.store.volumes[volume_id] = attrs.evolve(volume, state=ATTACHED, checkpoint="")


@attrs.define
class Nodes:
    bucket: Bucket
    tmp_path: Path
    monkeypatch: Any


async def _settle(made: Node) -> None:
    await trio.testing.wait_all_tasks_blocked()
    await made.pods._changes.wait_idle()


def _node(nodes: Nodes, name: str) -> Any:
    """A node over the shared bucket: its own state directory, microVMs, volumes and diskd."""
    root = nodes.tmp_path / name
    root.mkdir()
    return node(root, nodes.monkeypatch, vms=SnapshotVms(root), volumes=CheckpointVolumes(),
                diskd=StoreDiskd(nodes.bucket, root))


@pytest.fixture
def nodes(tmp_path: Path, monkeypatch: Any) -> Nodes:
    return Nodes(Bucket(), tmp_path, monkeypatch)


def _methods(made: Node) -> list[str]:
    return [m for m, _ in made.diskd.calls]


async def test_a_running_pod_hibernates_and_resumes_from_its_checkpoint(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        answer = await made.pods.hibernate_pod({"id": P1})
        ref = answer["pod"]["checkpoint"]
        assert answer["pod"]["state"] == "hibernated" and ref.startswith("sha256:")
        assert made.records.kept[P1]["checkpoint"] == ref
        assert "hibernation" not in (await made.pods.get_pod({"id": P1}))["pod"]
        assert P1 not in made.vms.vms  # the microVM, its disk and its addresses went
        assert P1 not in made.diskd.states
        assert [m for m in _methods(made) if m not in ("memoryTransfer", "stopDisk")][:4] == [
            "bake", "push", "pushMemory", "putCheckpoint"]
        resumed = await made.pods.resume_pod({"id": P1})
        assert resumed["pod"]["state"] == "running"
        assert made.vms.restored[P1] == b"the memory of " + P1.encode()
        assert made.records.kept[P1]["checkpoint"] == ""
        assert ["getCheckpoint", "pull", "createDisk", "pullMemory"] == [
            m for m in _methods(made) if m in ("getCheckpoint", "pull", "createDisk",
                                               "pullMemory")]


async def test_a_second_call_joins_the_hibernation_in_flight(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        made.diskd.hold("push")
        answers: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(lambda: _append(answers, made.pods.hibernate_pod({"id": P1})))
            await made.diskd.reached["push"].wait()
            progress = (await made.pods.get_pod({"id": P1}))["pod"]["hibernation"]
            assert progress["phase"] == "upload" and progress["bytesTotal"] > 0
            made.diskd.held.pop("push").set()
        assert [a["pod"]["state"] for a in answers] == ["hibernated", "hibernated"]
        assert _methods(made).count("bake") == 1


async def _append(into: list[Any], call: Any) -> None:
    into.append(await call)


async def test_a_resume_abandons_a_hibernation_before_its_commit_point(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        made.diskd.hold("push")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_expect_hibernated_not, made)
            await made.diskd.reached["push"].wait()
            resumed = await made.pods.resume_pod({"id": P1})
        assert resumed["pod"]["state"] == "running"
        assert made.diskd.aborted == [LAYER]
        assert "putCheckpoint" not in _methods(made)
        assert made.records.kept[P1]["checkpoint"] == ""


async def _expect_hibernated_not(made: Node) -> None:
    with pytest.raises(FeosError, match="abandoned by a resume") as caught:
        await made.pods.hibernate_pod({"id": P1})
    assert caught.value.code is Code.ABORTED


async def test_no_abandon_makes_the_resume_wait_and_restore(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        made.diskd.hold("pushMemory")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: made.pods.hibernate_pod({"id": P1, "noAbandon": True}))
            await made.diskd.reached["pushMemory"].wait()
            nursery.start_soon(lambda: made.pods.resume_pod({"id": P1}))
            await trio.sleep(5)
            made.diskd.held.pop("pushMemory").set()
        assert made.diskd.aborted == []
        assert "putCheckpoint" in _methods(made) and "pullMemory" in _methods(made)
        assert made.state(P1) == "running"


async def test_the_store_refusing_fails_the_hibernation_and_the_pod_runs_on(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        made.diskd.refuse.add("pushMemory")
        with pytest.raises(FeosError, match="AccessDenied.*it runs on") as caught:
            await made.pods.hibernate_pod({"id": P1})
        assert caught.value.code is Code.UNAVAILABLE
        assert made.state(P1) == "running"
        assert "putCheckpoint" not in _methods(made)


async def test_a_stopped_pod_hibernates_on_its_disks_alone_and_boots_on_them(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as made:
        await running_pod(made)
        await made.pods.stop_pod({"id": P1})
        assert (await made.pods.hibernate_pod({"id": P1}))["pod"]["state"] == "hibernated"
        assert "pushMemory" not in _methods(made)
        await made.pods.resume_pod({"id": P1})
        await _settle(made)
        assert made.state(P1) == "running"  # booted anew on the checkpoint's disk
        assert "pullMemory" not in _methods(made)


async def test_a_volume_is_checkpointed_and_attached_again_at_the_restore(
        nodes: Nodes, autojump_clock: Any) -> None:
    volume_id = "00000000-0000-4000-8000-000000000001"
    async with _node(nodes, "a") as made:
        made.volumes.store.volumes[volume_id] = Volume(volume_id, 64 << 20, (), ATTACHED, P1)
        spec = {**SPEC, "volumes": [{"name": "data", "volumeId": volume_id}]}
        await made.pods.create_pod({"id": P1, "spec": spec})
        await _settle(made)
        await made.pods.hibernate_pod({"id": P1})
        volume = made.volumes.store.volumes[volume_id]
        assert (volume.state, volume.checkpoint) == (CHECKPOINTED, LAYER)
        await made.pods.resume_pod({"id": P1})
        assert made.volumes.store.volumes[volume_id].state == ATTACHED


async def test_restore_on_another_node_keeps_the_pods_id(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as first:
        await running_pod(first)
        ref = (await first.pods.hibernate_pod({"id": P1}))["pod"]["checkpoint"]
    async with _node(nodes, "b") as second:
        answer = await second.pods.restore_pod({"id": P1, "checkpoint": ref})
        assert answer["pod"]["id"] == P1 and answer["pod"]["state"] == "running"
        assert second.vms.restored[P1] == b"the memory of " + P1.encode()
        with pytest.raises(FeosError) as caught:
            await second.pods.restore_pod({"id": P1, "checkpoint": ref})
        assert caught.value.code is Code.ALREADY_EXISTS


async def test_checkpoints_missing_partial_or_damaged_are_refused_leaving_nothing(
        nodes: Nodes, autojump_clock: Any) -> None:
    async with _node(nodes, "a") as first:
        await running_pod(first)
        ref = (await first.pods.hibernate_pod({"id": P1}))["pod"]["checkpoint"]
    good = nodes.bucket[ref]
    async with _node(nodes, "b") as second:
        missing = "sha256:" + "9" * 64
        with pytest.raises(FeosError) as caught:
            await second.pods.restore_pod({"id": P1, "checkpoint": missing})
        assert caught.value.code is Code.NOT_FOUND
        nodes.bucket[ref] = good.replace(b"fakevmm", b"fakevmX")
        with pytest.raises(FeosError) as caught:
            await second.pods.restore_pod({"id": P1, "checkpoint": ref})
        assert caught.value.code is Code.DATA_LOSS
        nodes.bucket[ref] = good
        del nodes.bucket[LAYER]  # partial: a layer is gone
        with pytest.raises(FeosError) as caught:
            await second.pods.restore_pod({"id": P1, "checkpoint": ref})
        assert caught.value.code is Code.NOT_FOUND and LAYER in caught.value.message
        await _settle(second)
        assert second.pods._pods == {} and P1 not in second.records.kept
        assert P1 not in second.vms.vms and second.diskd.states.get(P1) is None


async def test_a_restore_needs_the_snapshots_vmm_version(
        nodes: Nodes, autojump_clock: Any, monkeypatch: Any) -> None:
    async with _node(nodes, "a") as first:
        await running_pod(first)
        ref = (await first.pods.hibernate_pod({"id": P1}))["pod"]["checkpoint"]
    async with _node(nodes, "b") as second:
        monkeypatch.setattr(SnapshotVms, "vmm_version", lambda self, driver=None: "fakevmm 2.0")
        with pytest.raises(FeosError, match="fakevmm 1.0; this node has fakevmm 2.0") as caught:
            await second.pods.restore_pod({"id": P1, "checkpoint": ref})
        assert caught.value.code is Code.FAILED_PRECONDITION
        assert second.pods._pods == {}


def test_a_checkpoint_reads_back_as_it_was_and_a_foreign_one_is_data_loss() -> None:
    from feos.pods._hibernate import Checkpoint, SavedVolume

    made = Checkpoint(pod_id=P1, spec={"memoryMib": 256}, guest_version="g1", driver="qemu",
                      vmm="qemu 7.2.22", disk=LAYER, disk_bytes=1 << 30,
                      volumes=(SavedVolume("v", LAYER, 64 << 20, True),), memory=MEMORY,
                      memory_bytes=5, disk_origin="blank:g1", created_unix_ns=1)
    assert Checkpoint.from_json(made.to_json(), "ref") == made
    assert made.layers() == [LAYER, LAYER]
    for body in (b"{", b"[]", b'{"format": "other/1"}',
                 made.to_json().replace(b'"pod_id"', b'"pod"'),
                 made.to_json().replace(b'"memoryMib":256', b'"memoryMib":3')):
        with pytest.raises(FeosError) as caught:
            Checkpoint.from_json(body, "ref")
        assert caught.value.code is Code.DATA_LOSS and "checkpoint ref" in caught.value.message
