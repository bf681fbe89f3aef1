"""What the pod service asks of its collaborators, as Protocols (the network's is _network.py).

The microVM service (feos.vmm.MicroVms), an attached guest (feos.vmm.GuestHandle over the node's
guest client), the volumes (VolumeService) and the stores of the security groups and name tables:
only the methods named here pass between them and the pods, so tests run the pod service over
fakes of each.

The guest client's values are imported here and nowhere else in feos.pods, so that the node's
side of the guest link can move with one line changed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from ..guestlink import ContainerConfig as ContainerConfig
from ..guestlink import ContainerState as ContainerState
from ..guestlink import Identity as Identity
from ..guestlink import NetworkConfig as NetworkConfig
from ..guestlink import VolumeMount as VolumeMount
from ..guestlink import VolumeOutcome as VolumeOutcome
from ..guestlink import VolumeSpec as VolumeSpec
from ..vmm import VmEvent, VmInfo, VmSpec
from ._volumes import Volume


class Guest(Protocol):
    """An attached guest: the GuestService calls the pods make, run on the guest link's thread."""

    @property
    def client(self) -> Any:
        """The guest client itself, for the relays that run on its thread (`call`)."""
        ...

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any: ...

    async def list_containers(self) -> list[ContainerState]: ...

    async def create_container(self, config: ContainerConfig) -> ContainerState: ...

    async def start_container(self, name: str) -> ContainerState: ...

    async def mount_volumes(self, volumes: list[VolumeSpec]) -> list[VolumeOutcome]: ...

    async def pull_image(self, reference: str, pull_token: str = "") -> tuple[str, bool]: ...

    async def freeze_filesystem(self) -> None: ...

    async def assume(self, identity: Identity) -> None: ...

    async def thaw_filesystem(self) -> None: ...


class MicroVmsPort(Protocol):
    """The microVM service: one microVM per pod, of the pod's ID. NOT_FOUND for one not made."""

    def get(self, vm_id: str) -> VmInfo: ...

    async def create(self, vm_id: str, spec: VmSpec) -> VmInfo: ...

    async def start(self, vm_id: str, *, wait_attach: bool = True) -> VmInfo: ...

    async def shutdown(self, vm_id: str, *, grace: float = ...) -> VmInfo: ...

    async def suspend(self, vm_id: str, *, purge_guest: bool = True) -> VmInfo: ...

    async def resume(self, vm_id: str) -> VmInfo: ...

    async def seed(self, vm_id: str, memory: Path) -> VmInfo:
        """A created microVM given a template's snapshot: SUSPENDED, for `resume`."""
        ...

    def snapshot(self, vm_id: str) -> Path:
        """A suspended microVM's memory file."""
        ...

    def list(self) -> list[VmInfo]: ...

    async def delete(self, vm_id: str) -> None:
        """Idempotent: a microVM that is not there is deleted."""
        ...

    def driver_for(self, vm_id: str) -> str:
        """The VMM the microVM runs on, or the node's own for one that is not running."""
        ...

    def probing(self) -> str:
        """While the node's VMM probe runs, what it does ("" once decided)."""
        ...

    async def decided(self) -> Any:
        """The node's VMM (a VmmChoice) once its probe has decided it."""
        ...

    async def guest(self, vm_id: str, *, within: float = ...) -> Any:
        """The attached guest (a `Guest`: GuestHandle reaches the client's methods through its
        __getattr__, which a Protocol does not see), or UNAVAILABLE once `within` passed."""
        ...

    def subscribe(self, buffer: int = 256) -> trio.MemoryReceiveChannel[VmEvent]: ...

    def snapshot_file(self, vm_id: str) -> Path: ...

    def vmm_version(self, driver: str | None = None) -> str: ...

    async def restore(self, vm_id: str, spec: VmSpec, *, guest_version: str, driver: str,
                      memory: Path) -> VmInfo: ...


class VolumeStore(Protocol):
    def get(self, record_id: str) -> Volume | None: ...

    def __iter__(self) -> Iterator[Volume]: ...


class Volumes(Protocol):
    """The node's volumes: each one pod's at a time, claimed at create, released at delete."""

    @property
    def store(self) -> VolumeStore: ...

    def disk_path(self, volume_id: str) -> Path: ...

    async def claim(self, pod_id: str, volume_ids: Sequence[str]) -> None: ...

    async def release(self, pod_id: str) -> None: ...

    async def mark_formatted(self, volume_id: str) -> None: ...

    async def checkpointed(self, pod_id: str, layers: dict[str, str]) -> None: ...

    async def take_checkpointed(self, pod_id: str, volumes: Sequence[Volume]) -> None: ...

    async def forget_checkpointed(self, pod_id: str) -> None: ...

    async def opened(self, volume_id: str) -> None: ...


class Ids(Protocol):
    def __contains__(self, record_id: str) -> bool: ...


class Named(Protocol):
    """The security groups or the name tables: a pod's spec names them by ID."""

    @property
    def store(self) -> Ids: ...


class Records(Protocol):
    """The pods' records (feos.records.RecordDir): written in order on a thread of their own."""

    async def put(self, record_id: str, value: dict[str, Any]) -> Any: ...

    async def remove(self, record_id: str) -> None: ...

    def load(self) -> dict[str, dict[str, Any]]: ...

    def close(self) -> None: ...
