"""A pod's bring-up, step by step: (vmm-probe while feosd's VMM probe runs,) disk, vm, guest,
volumes, containers.

Every step looks at what is there first (the disk, the microVM, the containers the guest has), so
a bring-up that a restart or a stop cut off goes on where it ended. The bring-up runs as a change
(feos.pods._changes) under the pod's lock; it raises FeosError for a step that failed, and the
pod service records RUNNING or FAILED from its end.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from ..errors import Code, FeosError
from ..vmm import VmInfo, VmSpec, VmState, guest_root, newest_guest
from ._bake import Baker, choose_base, on_layer, token_for
from ._disks import DiskFile, PodDisks
from ._netface import NetworkFace
from ._pod import Pod
from ._ports import (
    ContainerConfig,
    Guest,
    Identity,
    MicroVmsPort,
    VolumeMount,
    Volumes,
    VolumeSpec,
)
from ._templates import Template, Templates

log = logging.getLogger(__name__)

GUEST_WITHIN_S = 5.0


class BringUp:
    def __init__(
        self,
        state_dir: Path,
        vms: MicroVmsPort,
        volumes: Volumes,
        *,
        disks: PodDisks,
        network: NetworkFace,
        step: Callable[[Pod, str], None],
        keep: Callable[[Pod], Awaitable[None]],
        attach_s: float,
        baker: Baker | None = None,
        templates: Templates | None = None,
    ) -> None:
        self._state_dir = state_dir
        self._vms = vms
        self._volumes = volumes
        self._disks = disks
        self._network = network
        self._step = step
        self._keep = keep
        self.attach_s = attach_s
        self._baker = baker or Baker(None, _nowhere)
        self.templates = templates
        self._picked: dict[str, Template] = {}  # pod -> the template its new disk is made on

    async def run(self, pod: Pod) -> None:
        """Every step, RUNNING left to the caller; FeosError naming what failed."""
        token, pod.pull_token = pod.pull_token, ""
        if self._vms.probing():  # feosd serves before its VMM probe ends: the create waits
            self._step(pod, "vmm-probe")
            log.info("pod %s waits for the VMM probe: %s", pod.id, self._vms.probing())
            await self._vms.decided()
        self._step(pod, "disk")
        # A disk made by this bring-up holds no containers: no listContainers to ask (a guest
        # call, one of three on the containers' path). A bring-up cut off after the disk was
        # made finds it there next time and asks.
        vm_spec, fresh = await self._prepare(pod)
        if fresh:
            await self._keep(pod)  # what the disk was made on
        token = token_for(pod, token)  # a disk on a baked layer has its image
        self._step(pod, "vm")
        template = self._picked.pop(pod.id, None)
        info = await self._ensure_vm(pod, vm_spec)
        if template is not None and info.state is VmState.CREATED:
            info = await self._restore(pod, template, vm_spec)
        if info.state is not VmState.RUNNING:
            pod.came_up = "cold"
            await self._vms.start(pod.id, wait_attach=False)
        self._step(pod, "guest")
        guest = await self._attached(pod)
        await assume(pod, guest, restored=pod.came_up.startswith("template:"))
        self._step(pod, "volumes")
        await self._mount_volumes(pod, guest)
        await self._baker.bake_point(pod, guest, token)
        self._step(pod, "containers")
        await self._start_containers(pod, guest, token, fresh=fresh)

    async def _restore(self, pod: Pod, template: Template, spec: VmSpec) -> VmInfo:
        """The pod's new microVM restored from the template's snapshot; a restore that fails
        leaves a created microVM (made anew) to boot cold on the same disk."""
        assert self.templates is not None
        try:
            await self._vms.seed(pod.id, self.templates.memory(template))
            info = await self._vms.resume(pod.id)
            pod.came_up = f"template:{template.name}"
            return info
        except FeosError as exc:
            log.warning("pod %s: the restore from template %s failed (%s): it boots cold",
                        pod.id, template.name, exc.message)  # fmt: skip
            await self._vms.delete(pod.id)
            return await self._ensure_vm(pod, spec)

    async def _choose(self, pod: Pod, guest: str, blank: str) -> str:
        """The new disk's base: a fitting template's layer where the node has one."""
        base = await choose_base(self._baker.diskd, pod, guest, blank)
        if self.templates is not None:
            image = pod.spec.containers[0].image if on_layer(pod) else ""
            one = len(pod.spec.containers) == 1 and not on_layer(pod)
            held = pod.spec.containers[0].image if one else ""
            template = await self.templates.fitting(pod, base, image, held)
            if template is not None:
                self._picked[pod.id] = template
                return template.layer
        return base

    def _vm(self, pod: Pod) -> VmInfo | None:
        try:
            return self._vms.get(pod.id)
        except FeosError:
            return None

    async def _prepare(self, pod: Pod) -> tuple[VmSpec, bool]:
        """The disks (diskd's, started for the microVM's VMM) and the link: what the microVM is
        made with; and whether the pod's disk was made now."""
        info = self._vm(pod)
        if info is not None:
            guest_dir = guest_root() / info.guest_version
        else:
            _, guest_dir = newest_guest(guest_root())
        vmm = self._vms.driver_for(pod.id)
        choose = functools.partial(self._choose, pod, guest_dir.name)
        disk, fresh = await self._disks.pod(pod.id, guest_dir, pod.spec.disk_size_mib << 20, vmm,
                                            choose)
        volume_disks: list[DiskFile] = []
        for volume_id in pod.spec.volume_ids():
            volume = self._volumes.store.get(volume_id)
            if volume is None:
                raise FeosError(Code.FAILED_PRECONDITION, f"volume {volume_id} is not on this node")
            volume_disks.append(await self._disks.volume(
                volume_id, self._volumes.disk_path(volume_id), volume.size_bytes, vmm))
        if pod.spec.network is not None:
            pod.driver = vmm  # the network serves metadata for QEMU
        link = await self._network.prepare(pod)
        tap, mac = (link.tap, link.mac) if link is not None else (None, None)
        backing = dict.fromkeys(p for d in (disk, *volume_disks) for p in d.chain)
        spec = VmSpec(vcpus=pod.spec.vcpus, memory_mib=pod.spec.memory_mib, data_disk=disk.path,
                      data_format=disk.format, volumes=tuple(v.path for v in volume_disks),
                      volume_formats=tuple(v.format for v in volume_disks),
                      backing=tuple(backing), tap=tap, mac=mac, metadata=metadata(pod))
        return spec, fresh

    async def vm_spec(self, pod: Pod) -> VmSpec:
        """A restore's microVM: the disks it made started, the link made (feos.pods._hibernate)."""
        spec, _ = await self._prepare(pod)
        return spec

    async def _ensure_vm(self, pod: Pod, spec: VmSpec) -> VmInfo:
        info = self._vm(pod)
        if info is not None and info.state is VmState.SUSPENDED:
            await self._vms.delete(pod.id)  # a stopped pod boots anew on its disk
            info = None
        if info is None:
            info = await self._vms.create(pod.id, spec)
        driver = self._vms.driver_for(pod.id)  # a stopped microVM boots on the node's VMM
        if pod.guest_version != info.guest_version or pod.driver != driver:
            pod.guest_version, pod.driver = info.guest_version, driver
            await self._keep(pod)
        return info

    async def _attached(self, pod: Pod) -> Guest:
        deadline = trio.current_time() + self.attach_s
        last: FeosError | None = None
        while trio.current_time() < deadline:
            info = self._vms.get(pod.id)
            if info.state in (VmState.CRASHED, VmState.STOPPED):
                raise FeosError(Code.UNAVAILABLE, f"the microVM {info.state.value}: {info.reason}")
            try:
                within = min(GUEST_WITHIN_S, deadline - trio.current_time())
                guest: Guest = await self._vms.guest(pod.id, within=within)
                return guest
            except FeosError as exc:
                last = exc
        raise FeosError(Code.DEADLINE_EXCEEDED, f"the guest did not attach within "
                        f"{self.attach_s:g}s" + (f" ({last.message})" if last else ""))

    async def _mount_volumes(self, pod: Pod, guest: Guest) -> None:
        if not pod.spec.volumes:
            return
        asks = []
        for drive, (name, volume_id) in enumerate(pod.spec.volumes, start=1):
            volume = self._volumes.store.get(volume_id)
            assert volume is not None
            asks.append(VolumeSpec(name=name, drive=drive, size_bytes=volume.size_bytes,
                                   format=not volume.formatted, id=volume_id))
        outcomes = await guest.mount_volumes(asks)
        failed = []
        by_name = dict(pod.spec.volumes)
        for outcome in outcomes:
            if outcome.mounted:
                await self._volumes.mark_formatted(by_name[outcome.name])
            else:
                failed.append(f"{outcome.name}: {outcome.error}")
        if failed:
            raise FeosError(Code.FAILED_PRECONDITION, "volumes not mounted: " + "; ".join(failed))

    async def _start_containers(self, pod: Pod, guest: Guest, token: str, *,
                                fresh: bool = False) -> None:
        have = {} if fresh else {c.name: c for c in await guest.list_containers()}
        for container in pod.spec.containers:
            found = have.get(container.name)
            if found is not None and found.status == "running":
                continue
            try:
                if found is None and pod.came_up.startswith("template:"):
                    await check_held(guest, container.image, token)
                if found is None:
                    await guest.create_container(container_config(pod, container.name, token))
                await guest.start_container(container.name)
            except FeosError as exc:
                raise FeosError(exc.code, f"container {container.name}: {exc.message}") from None


async def check_held(guest: Guest, image: str, token: str) -> None:
    """The token rule for a restored guest that may hold the image (its template's guest
    pulled it anonymously): the image is pulled with the create's own token before the
    container is made of it. The pull asks the registry for the tag's manifest with that token
    and fetches only the blobs the store lacks: the digest the template held, nothing fetched;
    another digest, its blobs, as a cold create's pull; a token the registry refuses, the
    registry's error, as a cold create fails. A pull that joined one in flight used another's
    token: asked again."""
    for _ in range(3):
        _, joined = await guest.pull_image(image, token)
        if not joined:
            return
    raise FeosError(Code.UNAVAILABLE, f"the pull of {image} with the pod's token kept joining "
                    "others in flight")


async def assume(pod: Pod, guest: Guest, *, restored: bool) -> None:
    """The pod's identity in its guest, before anything of the pod runs there. A guest of a
    version before assume (a cold boot only: templates are made of the newest) goes without."""
    try:
        await guest.assume(identity(pod))
    except FeosError as exc:
        if restored:
            raise FeosError(exc.code, f"the restored guest did not take the pod's identity: "
                            f"{exc.message}") from None
        log.info("pod %s: the guest did not take its identity: %s", pod.id, exc.message)


def identity(pod: Pod) -> Identity:
    from feos.net import guest_mac

    return Identity(pod_id=pod.id, hostname=pod.id,
                    machine_id=hashlib.sha256(f"feos-machine-id:{pod.id}".encode()).hexdigest()[:32],
                    mac=guest_mac(pod.id) if pod.spec.network is not None else "",
                    entropy=os.urandom(64), realtime_ns=time.time_ns())  # fmt: skip


async def _nowhere(pod: Pod, digest: str) -> None:
    raise AssertionError("a bring-up without diskd baked nothing")


def container_config(pod: Pod, name: str, token: str) -> ContainerConfig:
    container = next(c for c in pod.spec.containers if c.name == name)
    return ContainerConfig(
        name=container.name, image=container.image, command=container.command,
        env=tuple(f"{k}={v}" for k, v in container.env),
        volume_mounts=tuple(VolumeMount(m.volume, m.path, m.read_only) for m in container.mounts),
        working_dir=container.working_dir, pull_token=token)


def metadata(pod: Pod) -> str:
    """The microVM's metadata: the node's part (ID, addresses) and the spec's object."""
    return json.dumps({"feos": {"pod-id": pod.id, "ipv6": pod.ipv6, "ipv4": pod.ipv4},
                       "metadata": json.loads(pod.spec.metadata_json)})
