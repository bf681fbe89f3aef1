"""PodService: pods as microVMs with containers, over the microVM layer and the guest.

Theory of operation. Each pod is a `_Pod` in `self._pods`, with a lock of its own. Every call
that changes a pod runs as a task of the service's nursery (`_change`), not the caller's: a
caller that goes away cancels only its wait, never the change. A task takes the pod's lock and
then checks that the pod is still the one it was called for (a pod deleted and created again
with the same ID is another `_Pod`), else NOT_FOUND.

CreatePod claims the volumes, records the pod PENDING, answers, and starts the bring-up in the
background (`_bring_up`), which holds the pod's lock while it runs: network link, disks,
microVM, guest attached, volumes mounted, containers created and started; RUNNING, or FAILED with
the reason. Every step looks at what is there first, so a bring-up that a restart cut off goes on
where it ended. StopPod and DeletePod end a bring-up first (cancel it, wait for it).

A state change is made in memory first (ListPods and GetPod never wait for a write), then kept on
the pod-records thread; the call answers and its event goes out once it is kept. What the
microVM does on its own (crashes, stops, is found suspended) comes as the microVM layer's events
and is applied under the pod's lock.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import _schema
from ..errors import Code, FeosError
from ..records import RecordDir
from ..rpc._server import Cap
from ..vmm._driver import VmSpec, VmState
from . import _lifecycle as lc
from ._disks import ensure_pod_disk, ensure_volume_disk, pod_disk, remove_pod_disk
from ._events import EventHub
from ._network import PodNet, PodNetworkService
from ._spec import PodSpec, check_pod_id, parse_spec
from ._streams import open_exec, open_logs
from ._volumes import VolumeService

log = logging.getLogger(__name__)

STOPPING = "feosd stops"
STOP_GRACE_S = 30.0
GUEST_S = 5.0


@attrs.define(eq=False)
class _Pod:
    id: str
    spec: PodSpec
    state: str = lc.PENDING
    reason: str = ""
    step: str = ""
    ipv6: str = ""
    ipv4: str = ""
    created_ns: int = 0
    changed_ns: int = 0
    guest_version: str = ""
    driver: str = ""
    image_layers: dict[str, Any] = attrs.field(factory=dict)
    generation: int = 0
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    bringup: trio.CancelScope | None = None
    bringup_done: trio.Event | None = None
    pull_token: str = attrs.field(default="", repr=False)  # memory only, for the next bring-up

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id, "spec": self.spec.to_dict(), "state": self.state,
            "reason": self.reason, "step": self.step, "ipv6Address": self.ipv6,
            "ipv4Address": self.ipv4, "createdUnixNs": self.created_ns,
            "changedUnixNs": self.changed_ns, "guestVersion": self.guest_version,
            "driver": self.driver, "imageLayers": self.image_layers,
            "generation": self.generation,
        }  # fmt: skip


def _from_record(data: dict[str, Any]) -> _Pod:
    return _Pod(
        id=check_pod_id(data.get("id", "")), spec=parse_spec(data.get("spec", {})),
        state=data.get("state", lc.PENDING), reason=data.get("reason", ""),
        step=data.get("step", ""), ipv6=data.get("ipv6Address", ""),
        ipv4=data.get("ipv4Address", ""), created_ns=data.get("createdUnixNs", 0),
        changed_ns=data.get("changedUnixNs", 0), guest_version=data.get("guestVersion", ""),
        driver=data.get("driver", ""), image_layers=data.get("imageLayers", {}),
        generation=data.get("generation", 0),
    )  # fmt: skip


class PodService:
    def __init__(
        self,
        state_dir: Path,
        vms: Any,
        volumes: VolumeService,
        *,
        network: PodNetworkService | None = None,
        network_reason: str = "the pods' network is not set up",
        groups: Any = None,
        tables: Any = None,
        bridge: Any = None,
        attach_timeout: float = 60.0,
    ) -> None:
        self.state_dir = state_dir
        self._vms = vms
        self._volumes = volumes
        self._network = network
        self._network_reason = network_reason
        self._groups = groups
        self._tables = tables
        self._bridge = bridge
        self._attach_timeout = attach_timeout
        self._records = RecordDir(state_dir / "pods", _schema.pod().PodInfo,
                                  thread_name="pod-records")
        self._pods: dict[str, _Pod] = {}
        self._pods_lock = trio.Lock()
        self.events = EventHub()
        self._nursery: trio.Nursery | None = None
        self.stopping = False

    # -- running ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read the kept pods (before the network starts: its table is made from them)."""
        for pod_id, data in self._records.load().items():
            try:
                pod = _from_record(data)
            except FeosError as exc:
                log.error("pod record %s is not valid (%s): left out", pod_id, exc)
                continue
            self._pods[pod.id] = pod

    def attach_network(self, network: PodNetworkService) -> None:
        self._network = network

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._reconcile_volumes()
            await self._give_addresses()
            for pod in list(self._pods.values()):
                await self._take_over(pod)
            self._network_changed()
            loaded = getattr(self._network, "pods_loaded", None)
            if loaded is not None:
                loaded()  # the resolver answers the queries that waited
            nursery.start_soon(self._follow_vms, self._vms.subscribe())
            task_status.started(self)
            await trio.sleep_forever()

    async def _give_addresses(self) -> None:
        """Kept pods with a network get the addresses they lack (one of an earlier network)."""
        if self._network is None or self._network.unavailable() is not None:
            return
        for pod in self._pods.values():
            if pod.spec.network is None:
                continue
            try:
                net = await self._network.allocate(self._net(pod))
            except FeosError as exc:
                log.error("pod %s: no addresses: %s", pod.id, exc)
                continue
            if (net.ipv6, net.ipv4) != (pod.ipv6, pod.ipv4):
                pod.ipv6, pod.ipv4 = net.ipv6, net.ipv4
                await self._keep(pod)

    async def _reconcile_volumes(self) -> None:
        """Let go of volumes whose pod is gone; claim those of kept pods that name no pod."""
        for volume in list(self._volumes.store):
            if volume.pod_id and volume.pod_id not in self._pods:
                log.warning("volume %s: its pod %s is gone; it is available", volume.id,
                            volume.pod_id)
                await self._volumes.release(volume.pod_id)
        for pod in self._pods.values():
            try:
                await self._volumes.claim(pod.id, pod.spec.volume_ids())
            except FeosError as exc:
                log.error("pod %s: its volumes could not be claimed: %s", pod.id, exc)

    async def _take_over(self, pod: _Pod) -> None:
        """A kept pod after a restart: its microVM's record decides, a cut bring-up goes on."""
        try:
            vm = self._vms.get(pod.id)
        except FeosError:
            vm = None
        if pod.state == lc.PENDING:
            self._spawn_bring_up(pod)
        elif pod.state == lc.RUNNING:
            if vm is None or vm.state in (VmState.CRASHED, VmState.CREATED):
                reason = "its microVM is gone" if vm is None else (
                    vm.reason or f"its microVM was {vm.state.value}, not running")
                await self._set(pod, lc.FAILED, reason)
            elif vm.state is VmState.STOPPED:
                await self._set(pod, lc.STOPPED, vm.reason)
            elif vm.state is VmState.SUSPENDED:
                await self._set(pod, lc.SUSPENDED, "its microVM was suspended")

    async def _follow_vms(self, events: trio.MemoryReceiveChannel[Any]) -> None:
        async for event in events:
            pod = self._pods.get(event.id)
            if pod is None:
                continue
            kind = type(event).__name__
            if kind in ("Crashed", "Stopped", "Suspended"):
                reason = getattr(event, "reason", "")
                self._nursery.start_soon(self._vm_did, pod, kind.lower(), reason)  # type: ignore[union-attr]

    async def _vm_did(self, pod: _Pod, what: str, reason: str) -> None:
        async with pod.lock:
            if self._pods.get(pod.id) is not pod or pod.state != lc.RUNNING:
                return
            state = lc.next_state(pod.state, what, pod.id)
            await self._set(pod, state, f"its microVM {what}: {reason}" if reason else "")

    # -- state, records, events ------------------------------------------------------------

    async def _set(self, pod: _Pod, state: str, reason: str = "", step: str = "") -> None:
        pod.state, pod.reason, pod.step = state, reason, step
        pod.changed_ns = time.time_ns()
        pod.generation += 1
        await self._keep(pod)
        self.events.publish(pod.id, state, reason=reason, step=step)

    async def _keep(self, pod: _Pod) -> None:
        with trio.CancelScope(shield=True):
            await self._records.put(pod.id, pod.record())

    async def _step(self, pod: _Pod, step: str) -> None:
        pod.step = step
        self.events.publish(pod.id, pod.state, step=step)

    def _get(self, pod_id: str) -> _Pod:
        pod = self._pods.get(check_pod_id(pod_id))
        if pod is None:
            raise FeosError(Code.NOT_FOUND, f"pod {pod_id} does not exist")
        return pod

    def _refuse_while_stopping(self) -> None:
        if self.stopping:
            raise FeosError(Code.UNAVAILABLE, STOPPING)

    async def _change(self, pod: _Pod, fn: Callable[[_Pod], Awaitable[Any]], *,
                      end_bringup: bool = False) -> Any:
        """Run fn under the pod's lock in a task of the service: the caller may go, it goes on."""
        assert self._nursery is not None
        done = trio.Event()
        outcome: list[tuple[bool, Any]] = []

        async def task() -> None:
            try:
                if end_bringup:
                    await self._end_bring_up(pod)
                async with pod.lock:
                    if self._pods.get(pod.id) is not pod:
                        raise FeosError(Code.NOT_FOUND, f"pod {pod.id} does not exist")
                    outcome.append((True, await fn(pod)))
            except Exception as exc:  # handed to the caller
                outcome.append((False, exc))
            finally:
                done.set()

        self._nursery.start_soon(task)
        await done.wait()
        if not outcome:
            raise FeosError(Code.UNAVAILABLE, STOPPING)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    # -- the network ------------------------------------------------------------------------

    def _net(self, pod: _Pod) -> PodNet:
        network = pod.spec.network
        assert network is not None
        driver = pod.driver or self._vms.driver_for(pod.id)
        return PodNet(pod.id, pod.ipv6, pod.ipv4, network.security_groups, network.name_tables,
                      network.dns_upstreams, pod.spec.metadata_json, driver)

    def network_pods(self) -> list[PodNet]:
        return [self._net(p) for p in self._pods.values() if p.spec.network is not None]

    def _network_changed(self) -> None:
        if self._network is not None:
            self._network.pods_changed()

    async def guest_network(self, pod_id: str) -> Any:
        """The guest's network configuration, pushed after an attach and a resume."""
        pod = self._pods.get(pod_id)
        if pod is None or pod.spec.network is None or self._network is None or not pod.ipv6:
            return None
        from ..guest._client import NetworkConfig

        config = self._network.guest_network(self._net(pod))
        return NetworkConfig(ipv6=config.ipv6, ipv4=config.ipv4, resolvers=(config.resolver,),
                             mtu=config.mtu)

    def _check_network(self, spec: PodSpec) -> None:
        if spec.network is None:
            return
        if self._network is None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pods with a network cannot be made: {self._network_reason}")
        reason = self._network.unavailable()
        if reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pods with a network cannot be made: {reason}")

    def _check_named(self, pod: _Pod) -> None:
        """A pod whose groups or name tables the node lacks does not boot or resume."""
        network = pod.spec.network
        if network is None:
            return
        missing = [f"security group {g}" for g in network.security_groups
                   if self._groups is not None and g not in self._groups.store]
        missing += [f"name table {t}" for t in network.name_tables
                    if self._tables is not None and t not in self._tables.store]
        if missing:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pod {pod.id} names what the node does not have: {', '.join(missing)}")

    def pods_naming_group(self, group_id: str) -> list[str]:
        return [p.id for p in self._pods.values()
                if p.spec.network is not None and group_id in p.spec.network.security_groups]

    def pods_naming_table(self, table_id: str) -> list[str]:
        return [p.id for p in self._pods.values()
                if p.spec.network is not None and table_id in p.spec.network.name_tables]

    # -- the bring-up -----------------------------------------------------------------------

    def _spawn_bring_up(self, pod: _Pod) -> None:
        assert self._nursery is not None
        pod.bringup = trio.CancelScope()
        pod.bringup_done = trio.Event()
        self._nursery.start_soon(self._run_bring_up, pod, pod.bringup, pod.bringup_done)

    async def _run_bring_up(self, pod: _Pod, scope: trio.CancelScope, done: trio.Event) -> None:
        try:
            with scope:
                async with pod.lock:
                    if self._pods.get(pod.id) is not pod or pod.state != lc.PENDING:
                        return
                    try:
                        await self._bring_up(pod)
                    except FeosError as exc:
                        await self._failed(pod, exc.message)
                    except Exception as exc:
                        log.exception("pod %s: the bring-up failed", pod.id)
                        await self._failed(pod, f"{type(exc).__name__}: {exc}")
        finally:
            if pod.bringup is scope:
                pod.bringup = None
            done.set()

    async def _failed(self, pod: _Pod, reason: str) -> None:
        where = f" ({pod.step})" if pod.step else ""
        log.warning("pod %s failed%s: %s", pod.id, where, reason)
        await self._set(pod, lc.FAILED, reason)

    async def _end_bring_up(self, pod: _Pod) -> None:
        if pod.bringup is not None and pod.bringup_done is not None:
            pod.bringup.cancel()
            await pod.bringup_done.wait()

    async def _bring_up(self, pod: _Pod) -> None:
        token, pod.pull_token = pod.pull_token, ""
        self._check_named(pod)
        await self._step(pod, "disk")
        # A disk made by this bring-up holds no containers: no listContainers to ask (a guest
        # call, one of three on the containers' path). A bring-up cut off after the disk was
        # made finds it there next time and asks.
        fresh = not pod_disk(self.state_dir, pod.id).exists()
        vm_spec = await self._prepare(pod)
        await self._step(pod, "vm")
        info = await self._ensure_vm(pod, vm_spec)
        if info.state is not VmState.RUNNING:
            await self._vms.start(pod.id, wait_attach=False)
        await self._step(pod, "guest")
        guest = await self._attached(pod)
        await self._step(pod, "volumes")
        await self._mount_volumes(pod, guest)
        await self._step(pod, "containers")
        await self._start_containers(pod, guest, token, fresh=fresh)
        await self._set(pod, lc.RUNNING)

    async def _prepare(self, pod: _Pod) -> VmSpec:
        """The disks and the link: what the microVM is made with."""
        from ..vmm._service import guest_root, newest_guest

        try:
            version = self._vms.get(pod.id).guest_version
            guest_dir = guest_root() / version
        except FeosError:
            version, guest_dir = newest_guest(guest_root())
        disk = await ensure_pod_disk(self.state_dir, pod.id, guest_dir, pod.spec.disk_size_mib)
        volume_disks = []
        for volume_id in pod.spec.volume_ids():
            volume = self._volumes.store.get(volume_id)
            if volume is None:
                raise FeosError(Code.FAILED_PRECONDITION, f"volume {volume_id} is not on this node")
            path = await ensure_volume_disk(self._volumes.disk_path(volume_id), volume.size_bytes)
            volume_disks.append(str(path))
        tap = mac = None
        if pod.spec.network is not None:
            if self._network is None:
                raise FeosError(Code.FAILED_PRECONDITION, self._network_reason)
            pod.driver = self._vms.driver_for(pod.id)  # the network serves metadata for QEMU
            link = await self._network.prepare(self._net(pod))
            tap, mac = link.tap, link.mac
        return VmSpec(vcpus=pod.spec.vcpus, memory_mib=pod.spec.memory_mib, data_disk=str(disk),
                      volumes=tuple(volume_disks), tap=tap, mac=mac,
                      metadata=self._metadata(pod))

    def _metadata(self, pod: _Pod) -> str:
        return json.dumps({"feos": {"pod-id": pod.id, "ipv6": pod.ipv6, "ipv4": pod.ipv4},
                           "metadata": json.loads(pod.spec.metadata_json)})

    async def _ensure_vm(self, pod: _Pod, spec: VmSpec) -> Any:
        try:
            info = self._vms.get(pod.id)
        except FeosError:
            info = None
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

    async def _attached(self, pod: _Pod) -> Any:
        deadline = trio.current_time() + self._attach_timeout
        last: FeosError | None = None
        while trio.current_time() < deadline:
            info = self._vms.get(pod.id)
            if info.state in (VmState.CRASHED, VmState.STOPPED):
                raise FeosError(Code.UNAVAILABLE, f"the microVM {info.state.value}: {info.reason}")
            try:
                within = min(5.0, deadline - trio.current_time())
                return await self._vms.guest(pod.id, within=within)
            except FeosError as exc:
                last = exc
        raise FeosError(Code.DEADLINE_EXCEEDED, f"the guest did not attach within "
                        f"{self._attach_timeout:g}s" + (f" ({last.message})" if last else ""))

    async def _mount_volumes(self, pod: _Pod, guest: Any) -> None:
        if not pod.spec.volumes:
            return
        from ..guest._client import VolumeSpec as GuestVolume

        asks = []
        for drive, (name, volume_id) in enumerate(pod.spec.volumes, start=1):
            volume = self._volumes.store.get(volume_id)
            assert volume is not None
            asks.append(GuestVolume(name=name, drive=drive, size_bytes=volume.size_bytes,
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

    async def _start_containers(self, pod: _Pod, guest: Any, token: str, *,
                                fresh: bool = False) -> None:
        from ..guest._client import ContainerConfig, VolumeMount

        have = {} if fresh else {c.name: c for c in await guest.list_containers()}
        for container in pod.spec.containers:
            found = have.get(container.name)
            if found is not None and found.status == "running":
                continue
            if found is None:
                config = ContainerConfig(
                    name=container.name, image=container.image, command=container.command,
                    env=tuple(f"{k}={v}" for k, v in container.env),
                    volume_mounts=tuple(VolumeMount(m.volume, m.path, m.read_only)
                                        for m in container.mounts),
                    working_dir=container.working_dir, pull_token=token)
                try:
                    await guest.create_container(config)
                except FeosError as exc:
                    raise FeosError(exc.code,
                                    f"container {container.name}: {exc.message}") from None
            try:
                await guest.start_container(container.name)
            except FeosError as exc:
                raise FeosError(exc.code, f"container {container.name}: {exc.message}") from None

    # -- the API: create, get, list ---------------------------------------------------------

    async def create_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod_id = check_pod_id(params.get("id", ""))
        spec = parse_spec(params.get("spec", {}))
        token = params.get("pullToken", "")
        async with self._pods_lock:
            found = self._pods.get(pod_id)
            if found is not None:
                if found.spec != spec:
                    raise FeosError(Code.ALREADY_EXISTS, f"pod {pod_id} exists with another spec")
                return {"pod": self._answer(found)}
            self._check_network(spec)
            now = time.time_ns()
            pod = _Pod(pod_id, spec, created_ns=now, changed_ns=now,
                       image_layers=params.get("imageLayers", {}), pull_token=token)
            if spec.network is not None and self._network is not None:
                self._network.check_spec(self._net(pod))
            await self._volumes.claim(pod_id, spec.volume_ids())
            try:
                if spec.network is not None and self._network is not None:
                    net = await self._network.allocate(self._net(pod))
                    pod.ipv6, pod.ipv4 = net.ipv6, net.ipv4
                self._pods[pod_id] = pod
                await self._keep(pod)
            except BaseException:
                self._pods.pop(pod_id, None)
                with trio.CancelScope(shield=True):
                    await self._volumes.release(pod_id)
                raise
        self.events.publish(pod.id, pod.state, step="created")
        self._network_changed()
        self._spawn_bring_up(pod)
        return {"pod": self._answer(pod)}

    def _answer(self, pod: _Pod, containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        answer = pod.record()
        if containers:
            answer["containers"] = containers
        return answer

    async def get_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        pod = self._get(params.get("id", ""))
        containers = None
        if pod.state == lc.RUNNING:
            containers = await self._container_states(pod)
        return {"pod": self._answer(pod, containers)}

    async def _container_states(self, pod: _Pod) -> list[dict[str, Any]] | None:
        try:
            guest = await self._vms.guest(pod.id, within=GUEST_S)
            states = await guest.list_containers()
        except FeosError as exc:
            log.debug("pod %s: the containers' states: %s", pod.id, exc)
            return None
        status = {"created": "created", "running": "running", "stopped": "exited"}
        return [{"name": s.name, "state": status.get(s.status, "unknown"), "exitCode": s.exit_code,
                 "pid": s.pid, "startedUnixNs": s.started_ns, "finishedUnixNs": s.finished_ns}
                for s in states]

    async def list_pods(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"pods": [p.record() for p in list(self._pods.values())]}

    # -- the API: changes ------------------------------------------------------------------

    async def start_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod = self._get(params.get("id", ""))
        token = params.get("pullToken", "")

        async def start(pod: _Pod) -> None:
            if pod.state in (lc.RUNNING, lc.PENDING):
                return
            lc.next_state(pod.state, "start", pod.id)
            self._check_named(pod)
            pod.pull_token = token
            await self._set(pod, lc.PENDING, step="start")

        await self._change(pod, start)
        if pod.state == lc.PENDING and pod.bringup is None:
            self._spawn_bring_up(pod)
        return {"pod": self._answer(pod)}

    async def stop_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod = self._get(params.get("id", ""))

        async def stop(pod: _Pod) -> None:
            if pod.state == lc.STOPPED:
                return
            await self._stop_vm(pod)
            await self._set(pod, lc.STOPPED, "stopped by a call")

        await self._change(pod, stop, end_bringup=True)
        return {"pod": self._answer(pod)}

    async def _stop_vm(self, pod: _Pod) -> None:
        try:
            info = self._vms.get(pod.id)
        except FeosError:
            return
        if info.state is VmState.RUNNING:
            try:
                await self._vms.shutdown(pod.id, grace=STOP_GRACE_S)
                return
            except FeosError as exc:
                if exc.busy:
                    raise
                log.warning("pod %s: its microVM did not shut down (%s): removed", pod.id, exc)
        if info.state is VmState.BUSY:
            raise FeosError(Code.UNAVAILABLE, f"the VM is busy: {info.reason}", busy=True)
        if info.state is not VmState.STOPPED:
            await self._vms.delete(pod.id)

    async def delete_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod = self._get(params.get("id", ""))

        async def delete(pod: _Pod) -> None:
            await self._vms.delete(pod.id)
            if pod.spec.network is not None and self._network is not None:
                await self._network.remove(self._net(pod))
            await remove_pod_disk(self.state_dir, pod.id)
            await self._volumes.release(pod.id)
            async with self._pods_lock:
                # Out of the pods and its record's removal asked for in one step: no save of
                # the pod can land behind the removal.
                del self._pods[pod.id]
                try:
                    with trio.CancelScope(shield=True):
                        await self._records.remove(pod.id)
                except BaseException:
                    self._pods[pod.id] = pod
                    raise

        await self._change(pod, delete, end_bringup=True)
        self.events.publish(pod.id, pod.state, deleted=True, reason="deleted")
        self._network_changed()
        return {}

    async def suspend_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod = self._get(params.get("id", ""))
        await self._change(pod, self._suspend)
        return {"pod": self._answer(pod)}

    async def _suspend(self, pod: _Pod) -> None:
        if pod.state == lc.SUSPENDED:
            return
        lc.next_state(pod.state, "suspend", pod.id)
        await self._vms.suspend(pod.id)
        await self._set(pod, lc.SUSPENDED)

    async def resume_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        self._refuse_while_stopping()
        pod = self._get(params.get("id", ""))
        await self._change(pod, self._resume)
        return {"pod": self._answer(pod)}

    async def _resume(self, pod: _Pod) -> None:
        if pod.state == lc.RUNNING:
            return
        lc.next_state(pod.state, "resume", pod.id)
        self._check_named(pod)
        if pod.spec.network is not None and self._network is not None:
            await self._network.prepare(self._net(pod))
        await self._vms.resume(pod.id)
        await self._set(pod, lc.RUNNING)

    # -- the API: the guest's --------------------------------------------------------------

    async def _running_guest(self, pod_id: str) -> Any:
        pod = self._get(pod_id)
        if pod.state != lc.RUNNING:
            raise FeosError(Code.FAILED_PRECONDITION, f"pod {pod.id} is {pod.state}, not running")
        return await self._vms.guest(pod.id, within=GUEST_S)

    async def exec_in_pod(self, params: dict[str, Any]) -> dict[str, Any]:
        command = params.get("command", [])
        if not command:
            raise FeosError(Code.INVALID_ARGUMENT, "command: must name a program")
        guest = await self._running_guest(params.get("id", ""))
        env = [f"{kv['key']}={kv.get('value', '')}" for kv in params.get("env", [])]
        stream = await guest.call(open_exec, guest.client, params.get("container", ""),
                                  list(command), env)
        return {"stream": Cap(_schema.pod().ByteStream, stream)}

    async def pod_logs(self, params: dict[str, Any]) -> dict[str, Any]:
        guest = await self._running_guest(params.get("id", ""))
        stream = await guest.call(open_logs, guest.client, params.get("container", ""),
                                  bool(params.get("follow", False)))
        return {"stream": Cap(_schema.pod().ByteStream, stream)}

    async def watch_events(self, params: dict[str, Any]) -> dict[str, Any]:
        pod_id = params.get("podId", "")
        if pod_id:
            check_pod_id(pod_id, "podId")
        watcher = self.events.watch(pod_id)
        return {"stream": Cap(_schema.pod().EventStream, watcher)}

    # -- feosd's stop ------------------------------------------------------------------------

    def running(self) -> list[str]:
        return [p.id for p in self._pods.values() if p.state == lc.RUNNING]

    async def suspend_for_stop(self, pod_id: str) -> None:
        pod = self._get(pod_id)
        await self._change(pod, self._suspend)

    async def resume_after_stop(self, pod_id: str) -> None:
        pod = self._get(pod_id)
        await self._change(pod, self._resume)

    def is_suspended(self, pod_id: str) -> bool:
        pod = self._pods.get(pod_id)
        return pod is not None and pod.state == lc.SUSPENDED

    def close(self) -> None:
        self.events.close()
        self._records.close()
