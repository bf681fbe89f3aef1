"""Fakes of the pod service's collaborators (feos.pods._ports), for tests under the autojump clock.

Nothing here runs a thread: a thread's wait would let the autojump clock jump to the next
deadline. Any operation can be held: `fake.hold("delete")` makes the next and every later call
of it wait until `fake.let_go("delete")`; `fake.calls` lists what was called, in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError
from feos.pods import _bringup
from feos.pods._service import PodService
from feos.pods._volumes import Volume
from feos.vmm import Stopped, VmEvent, VmInfo, VmSpec, VmState

SPEC = {"network": {"none": None}, "memoryMib": 256}
P1, P2 = "pa0000000aa", "pb0000000bb"


class Holds:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self._held: dict[str, trio.Event] = {}
        self.waiting: dict[str, trio.Event] = {}

    def hold(self, name: str) -> None:
        self._held[name] = trio.Event()
        self.waiting[name] = trio.Event()

    def let_go(self, name: str) -> None:
        self._held.pop(name).set()

    async def at(self, name: str) -> None:
        self.calls.append(name)
        held = self._held.get(name)
        if held is not None:
            self.waiting[name].set()
            await held.wait()


class FakeGuest:
    def __init__(self, holds: Holds) -> None:
        self._holds = holds
        self.client = object()

    async def call(self, fn: Any, *args: Any) -> Any:
        return await fn(*args)

    async def list_containers(self) -> list[Any]:
        return []

    async def create_container(self, config: Any) -> Any:
        await self._holds.at("create_container")

    async def start_container(self, name: str) -> Any:
        await self._holds.at("start_container")

    async def mount_volumes(self, volumes: list[Any]) -> list[Any]:
        return []

    async def pull_image(self, reference: str, pull_token: str = "") -> tuple[str, bool]:
        await self._holds.at("pull_image")
        return "", False

    async def freeze_filesystem(self) -> None:
        await self._holds.at("freeze_filesystem")

    async def thaw_filesystem(self) -> None:
        await self._holds.at("thaw_filesystem")

    async def assume(self, identity: Any) -> None:
        await self._holds.at("assume")


class FakeVms(Holds):
    def __init__(self) -> None:
        super().__init__()
        self.vms: dict[str, VmInfo] = {}
        self.send, self.receive = trio.open_memory_channel[VmEvent](16)
        self.probe = ""  # what probing() says while the VMM probe runs (a test sets it)
        self.probe_done = trio.Event()
        self.probe_done.set()

    def probing(self) -> str:
        return self.probe

    async def decided(self) -> str:
        await self.probe_done.wait()
        return "fakevmm"

    def _set(self, vm_id: str, state: VmState) -> VmInfo:
        info = VmInfo(vm_id, state, "", "fakevmm", "tcg", "g1", 1, 256, state is VmState.RUNNING)
        self.vms[vm_id] = info
        return info

    def driver_for(self, vm_id: str) -> str:
        info = self.vms.get(vm_id)
        return info.driver if info is not None else "fakevmm"

    def list(self) -> list[VmInfo]:
        return list(self.vms.values())

    def get(self, vm_id: str) -> VmInfo:
        try:
            return self.vms[vm_id]
        except KeyError:
            raise FeosError(Code.NOT_FOUND, f"microVM {vm_id} does not exist") from None

    async def create(self, vm_id: str, spec: VmSpec) -> VmInfo:
        await self.at("create")
        return self._set(vm_id, VmState.CREATED)

    async def start(self, vm_id: str, *, wait_attach: bool = True) -> VmInfo:
        await self.at("start")
        return self._set(vm_id, VmState.RUNNING)

    async def shutdown(self, vm_id: str, *, grace: float = 30.0) -> VmInfo:
        await self.at("shutdown")
        return self._set(vm_id, VmState.STOPPED)

    async def suspend(self, vm_id: str, *, purge_guest: bool = True) -> VmInfo:
        await self.at("suspend")
        return self._set(vm_id, VmState.SUSPENDED)

    async def resume(self, vm_id: str) -> VmInfo:
        await self.at("resume")
        return self._set(vm_id, VmState.RUNNING)

    async def delete(self, vm_id: str) -> None:
        await self.at("delete")
        self.vms.pop(vm_id, None)

    async def guest(self, vm_id: str, *, within: float = 5.0) -> FakeGuest:
        with trio.move_on_after(within):
            await self.at("guest")
            return FakeGuest(self)
        raise FeosError(Code.UNAVAILABLE, f"the guest of pod {vm_id} did not answer")

    def subscribe(self, buffer: int = 256) -> trio.MemoryReceiveChannel[VmEvent]:
        return self.receive

    def stops_itself(self, vm_id: str) -> None:
        self._set(vm_id, VmState.STOPPED)
        self.send.send_nowait(Stopped(vm_id, "the guest shut down"))


@attrs.define
class FakeStore:
    volumes: dict[str, Volume] = attrs.field(factory=dict)

    def get(self, record_id: str) -> Volume | None:
        return self.volumes.get(record_id)

    def __iter__(self) -> Iterator[Volume]:
        return iter(list(self.volumes.values()))

    def __contains__(self, record_id: str) -> bool:
        return record_id in self.volumes


class FakeDiskd:
    """diskd as the pod service calls it: each disk's state, every call kept in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.states: dict[str, str] = {}

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]:
        disk_id = str(params.get("id", ""))
        self.calls.append((method, disk_id))
        if method == "startDisk":
            self.states[disk_id] = "started"
        elif method == "stopDisk":
            self.states[disk_id] = "stopped"
        elif method == "deleteDisk":
            if self.states.pop(disk_id, None) is None:
                raise FeosError(Code.NOT_FOUND, f"diskd has no disk {disk_id}")
            return {}
        return {"disk": {"id": disk_id, "path": f"/disks/{disk_id}/top.qcow2",
                         "format": "qcow2", "chain": []}}


class FakeVolumes(Holds):
    def __init__(self) -> None:
        super().__init__()
        self.store = FakeStore()
        self.claimed: dict[str, str] = {}

    def disk_path(self, volume_id: str) -> Path:
        return Path("/nonexistent") / volume_id

    async def claim(self, pod_id: str, volume_ids: Sequence[str]) -> None:
        await self.at("claim")

    async def release(self, pod_id: str) -> None:
        await self.at("release")

    async def mark_formatted(self, volume_id: str) -> None:
        pass


class FakeRecords(Holds):
    def __init__(self, kept: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.kept: dict[str, dict[str, Any]] = dict(kept or {})

    async def put(self, record_id: str, value: dict[str, Any]) -> Any:
        await self.at("put")
        self.kept[record_id] = value

    async def remove(self, record_id: str) -> None:
        await self.at("remove")
        self.kept.pop(record_id, None)

    def load(self) -> dict[str, dict[str, Any]]:
        return dict(self.kept)

    def close(self) -> None:
        pass


@attrs.define
class Node:
    pods: PodService
    vms: FakeVms
    volumes: FakeVolumes
    records: FakeRecords
    diskd: FakeDiskd

    def state(self, pod_id: str) -> str:
        return str(self.records.kept[pod_id]["state"])


async def _no_disks(self: _bringup.BringUp, pod: Any) -> tuple[VmSpec, bool]:
    return VmSpec(vcpus=pod.spec.vcpus, memory_mib=pod.spec.memory_mib), False


@contextlib.asynccontextmanager
async def node(tmp_path: Path, monkeypatch: Any, *, records: FakeRecords | None = None,
               vms: FakeVms | None = None, volumes: FakeVolumes | None = None,
               diskd: FakeDiskd | None = None) -> AsyncIterator[Node]:
    """A pod service over fakes, running; its nursery is cancelled at the end."""
    monkeypatch.setattr(_bringup.BringUp, "_prepare", _no_disks)
    vms = vms or FakeVms()
    volumes = volumes or FakeVolumes()
    records = records or FakeRecords()
    diskd = diskd or FakeDiskd()
    made = Node(PodService(tmp_path, vms, volumes, records=records, diskd=diskd), vms, volumes,
                records, diskd)
    made.pods.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(made.pods.run)
        yield made
        nursery.cancel_scope.cancel()


async def running_pod(made: Node, pod_id: str = P1) -> None:
    await made.pods.create_pod({"id": pod_id, "spec": SPEC})
    bringup = made.pods._pods[pod_id].bringup
    assert bringup is not None
    await bringup.done.wait()
    assert made.state(pod_id) == "running"
