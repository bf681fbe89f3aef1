"""PodService: pods as microVMs with containers, over the microVM layer and the guest.

Theory of operation. Each pod is a `Pod` (_pod.py) in `self._pods`, with a lock of its own.
Every call that changes a pod is a change of `self._changes` (_changes.py): a task of the
service's nursery, under the pod's lock, shielded and with a deadline of its kind, which its
caller only waits for. A change that got the lock acts only if the pod is still the one it was
called for (a pod deleted and created again with the same ID is another `Pod`), else NOT_FOUND.
Every state a change sets is the transition table's (_lifecycle.py), through `_apply`.

CreatePod claims the volumes, records the pod PENDING, answers, and submits the bring-up
(_bringup.py) as a change of its own: RUNNING, or FAILED with the reason. StopPod and DeletePod
end a bring-up first (cancel its own scope, wait for it).

A state change is made in memory first (ListPods and GetPod never wait for a write), then kept on
the pod-records thread within RECORD_S; the call answers and its event goes out once it is kept.
What the microVM does on its own (crashes, stops, is found suspended) comes as the microVM layer's
events and is applied as a change too. The node's stop refuses new changes, lets those in flight
end within --stop-grace and only then cancels them (`finish_changes`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from .. import _schema
from ..errors import Code, FeosError
from ..records import RecordDir
from ..rpc import Cap
from ..vmm import Crashed, Stopped, Suspended, VmEvent, VmInfo, VmState
from . import _lifecycle as lc
from ._api import (
    CreatePod,
    ExecInPod,
    HibernatePod,
    ListPods,
    PodLogs,
    PodRef,
    RestorePod,
    StartPod,
    WatchEvents,
    edge,
)
from ._bake import Baker
from ._bringup import BringUp
from ._changes import (
    CREATE_S,
    DELETE_S,
    RECORD_S,
    RESUME_S,
    SHUTDOWN_GRACE_S,
    START_S,
    STOP_S,
    STOPPING,
    Change,
    Changes,
    bounded_write,
    bring_up_s,
    lock_wait_s,
    suspend_s,
)
from ._console import console_log
from ._disks import DiskdPort, PodDisks, pod_disk
from ._events import EventHub
from ._hibernate import HIBERNATE_S, RESTORE_S, Hibernator, Progress
from ._netface import NetworkFace, naming
from ._network import PodNet, PodNetworkService
from ._pod import Pod, container_status, from_record
from ._ports import Guest, MicroVmsPort, Named, NetworkConfig, Records, Volumes
from ._spec import parse_spec
from ._streams import open_exec, open_logs
from ._templates import Templates, Warm

log = logging.getLogger(__name__)

T = TypeVar("T")
GUEST_S = 5.0
__all__ = ["STOPPING", "PodService"]


class PodService:
    def __init__(
        self,
        state_dir: Path,
        vms: MicroVmsPort,
        volumes: Volumes,
        *,
        network: PodNetworkService | None = None,
        network_reason: str = "the pods' network is not set up",
        groups: Named | None = None,
        tables: Named | None = None,
        bridge: object = None,
        attach_timeout: float = 60.0,
        records: Records | None = None,
        diskd: DiskdPort | None = None,
        warm_templates: tuple[Warm, ...] = (),
        templates_on_first_use: bool = False,
    ) -> None:
        self.state_dir = state_dir
        self._vms = vms
        self._volumes = volumes
        self._net = NetworkFace(network, network_reason, groups=groups, tables=tables,
                                driver_for=vms.driver_for)
        self._attach_timeout = attach_timeout
        self._records: Records = records or RecordDir(
            state_dir / "pods", _schema.pod().PodInfo, thread_name="pod-records")
        self._pods: dict[str, Pod] = {}
        self._pods_lock = trio.Lock()
        self._changes = Changes()
        self.disks = PodDisks(state_dir, diskd)  # the volume service's too (feosd sets it)
        self._baker = Baker(diskd, self._baked)
        # Templates need diskd (their disks are its layers); none without it.
        self.templates = None if diskd is None else Templates(
            state_dir, vms, diskd, on_first_use=templates_on_first_use,
            network=lambda: self._net.network)
        self._warm = warm_templates
        self._bringup = BringUp(state_dir, vms, volumes, disks=self.disks, network=self._net,
                                step=self._step, keep=self._keep, attach_s=attach_timeout,
                                baker=self._baker, templates=self.templates)
        self.events = EventHub()
        self._hib = Hibernator(state_dir, vms, volumes, diskd=diskd, disks=self.disks,
                               network=self._net, bringup=self._bringup, apply=self._apply,
                               keep=self._keep, tell=self._tell)

    # -- running ---------------------------------------------------------------------------

    def load(self) -> None:
        """Read the kept pods (before the network starts: its table is made from them)."""
        for pod_id, data in self._records.load().items():
            try:
                pod = from_record(data)
            except FeosError as exc:
                log.error("pod record %s is not valid (%s): left out", pod_id, exc)
                continue
            self._pods[pod.id] = pod

    def attach_network(self, network: PodNetworkService) -> None:
        self._net.network = network

    async def run(self, *, task_status: trio.TaskStatus[PodService] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._changes.open(nursery)
            await nursery.start(self._baker.run)
            if self.templates is not None:
                await nursery.start(functools.partial(self.templates.run, warm=self._warm,
                                                      is_pod=self._pods.__contains__))
            await self._reconcile_volumes()
            await self._give_addresses()
            for pod in list(self._pods.values()):
                await self._take_over(pod)
            self._net.changed()
            loaded = getattr(self._net.network, "pods_loaded", None)
            if loaded is not None:
                loaded()  # the resolver answers the queries that waited
            nursery.start_soon(self._follow_vms, self._vms.subscribe())
            if self.disks.serving:
                volumes = {v.id: self._volumes.disk_path(v.id) for v in self._volumes.store}
                nursery.start_soon(self.disks.adopt_plain_files, list(self._pods), volumes)
            task_status.started(self)
            await trio.sleep_forever()

    async def network_up(self) -> None:
        """The network came up after the pods were loaded (a mesh's prefix arrived): kept pods
        get the addresses they lack, running pods their TAP devices, the table follows."""
        await self._give_addresses()
        for pod in list(self._pods.values()):
            if pod.state == lc.RUNNING and pod.spec.network is not None:
                try:
                    await self._net.prepare(pod, boot=False)
                except FeosError as exc:
                    log.error("pod %s: its TAP device: %s", pod.id, exc)
        self._net.changed()

    async def _give_addresses(self) -> None:
        """Kept pods with a network get the addresses they lack (one of an earlier network)."""
        network = self._net.network
        if network is None or network.unavailable() is not None:
            return
        for pod in self._pods.values():
            if pod.state == lc.HIBERNATED:
                continue  # its addresses were given back
            try:
                changed = await self._net.allocate(pod)
            except FeosError as exc:
                log.error("pod %s: no addresses: %s", pod.id, exc)
                continue
            if changed:
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

    async def _take_over(self, pod: Pod) -> None:
        """A kept pod after a restart: its microVM's record decides, a cut bring-up goes on."""
        if pod.state == lc.PENDING:
            self._spawn_bring_up(pod)
            return
        if pod.state == lc.HIBERNATED:  # a release that the restart may have cut
            self._changes.submit(self._new_change(pod, "release", RESTORE_S,
                                                  self._hib.finish_release), node=True)
            return
        event, reason = found(self._vm(pod.id))
        if lc.allows(pod.state, event):
            await self._apply(pod, event, reason)

    def _disk_ids(self, pod: Pod) -> list[str]:
        return [pod.id, *pod.spec.volume_ids()]

    def _vm(self, pod_id: str) -> VmInfo | None:
        try:
            return self._vms.get(pod_id)
        except FeosError:
            return None

    async def _follow_vms(self, events: trio.MemoryReceiveChannel[VmEvent]) -> None:
        async for event in events:
            pod = self._pods.get(event.id)
            if pod is None or not isinstance(event, Crashed | Stopped | Suspended):
                continue
            what = type(event).__name__.lower()
            reason = getattr(event, "reason", "")
            self._changes.submit(self._new_change(pod, f"{what} microVM", RECORD_S,
                                                  self._vm_did(what, reason)), node=True)

    def _vm_did(self, what: str, reason: str) -> Callable[[Pod], Awaitable[None]]:
        async def apply(pod: Pod) -> None:
            if pod.state == lc.RUNNING:  # else the change that held the lock made it so
                await self._apply(pod, what, f"its microVM {what}: {reason}" if reason else "")
                await self.disks.stop(self._disk_ids(pod))

        return apply

    # -- state, records, events ------------------------------------------------------------

    async def _apply(self, pod: Pod, event: str, reason: str = "", step: str = "") -> bool:
        """The one place a pod's state changes: the table's next state, kept, then told."""
        state = lc.next_state(pod.state, event, pod.id)
        if state == pod.state:
            return False
        pod.state, pod.reason, pod.step = state, reason, step
        pod.changed_ns = time.time_ns()
        pod.generation += 1
        await self._keep(pod)
        self.events.publish(pod.id, state, reason=reason, step=step)
        return True

    async def _keep(self, pod: Pod) -> None:
        record = pod.record()
        await bounded_write(lambda: self._records.put(pod.id, record), f"pod {pod.id}'s record")

    async def _baked(self, pod: Pod, digest: str) -> None:
        """A layer baked of the pod is in the object store: its record and its watchers say so."""

        async def record(pod: Pod) -> None:
            pod.baked = digest
            await self._keep(pod)
            self.events.publish(pod.id, pod.state, reason=f"baked {digest} is in the object store")

        self._changes.submit(self._new_change(pod, "baked", RECORD_S, record), node=True)

    def _tell(self, pod: Pod, reason: str) -> None:
        self.events.publish(pod.id, pod.state, reason=reason)

    def _step(self, pod: Pod, step: str) -> None:
        pod.step = step
        self.events.publish(pod.id, pod.state, step=step)

    def _get(self, pod_id: str) -> Pod:
        pod = self._pods.get(pod_id)
        if pod is None:
            raise FeosError(Code.NOT_FOUND, f"pod {pod_id} does not exist")
        return pod

    def _is_current(self, pod: Pod) -> bool:
        return self._pods.get(pod.id) is pod

    # -- changes ---------------------------------------------------------------------------

    def _new_change(self, pod: Pod, what: str, deadline_s: float,
                    fn: Callable[[Pod], Awaitable[T]], **kw: Any) -> Change[T]:
        wait = lock_wait_s(pod.spec.memory_mib, self._attach_timeout)
        kw.setdefault("acts", self._is_current)
        return Change(pod, what, deadline_s, wait, fn, **kw)

    async def _change(self, pod: Pod, what: str, deadline_s: float,
                      fn: Callable[[Pod], Awaitable[T]], *, end_bringup: bool = False,
                      node: bool = False, **kw: Any) -> T:
        """Run fn as a change of the pod and wait for it: the caller may go, it goes on."""
        before = (lambda: self._end_bring_up(pod, what)) if end_bringup else None
        change = self._new_change(pod, what, deadline_s, fn, before=before, **kw)
        return await self._changes.submit(change, node=node).result()

    def _spawn_bring_up(self, pod: Pod) -> None:
        """The bring-up, a change of its own that nobody waits for (the node's: never refused,
        as the call that asked for it was taken)."""
        change = self._new_change(pod, "bring-up", bring_up_s(self._attach_timeout),
                                  self._bring_up, on_timeout=self._bring_up_late)
        pod.bringup = change
        self._changes.submit(change, node=True)

    async def _end_bring_up(self, pod: Pod, why: str) -> None:
        change = pod.bringup
        if change is not None and not change.done.is_set():
            change.end(f"a {why}")
            await change.done.wait()

    async def _bring_up(self, pod: Pod) -> None:
        if pod.state != lc.PENDING:
            return
        try:
            self._net.check_named(pod)
            await self._bringup.run(pod)
        except FeosError as exc:
            await self._failed(pod, exc.message)
            return
        except Exception as exc:
            log.exception("pod %s: the bring-up failed", pod.id)
            await self._failed(pod, f"{type(exc).__name__}: {exc}")
            return
        await self._apply(pod, "up")

    async def _bring_up_late(self, pod: Pod) -> None:
        seconds = bring_up_s(self._attach_timeout)
        await self._failed(pod, f"the bring-up did not end within {seconds:g}s")

    async def _failed(self, pod: Pod, reason: str) -> None:
        where = f" ({pod.step})" if pod.step else ""
        log.warning("pod %s failed%s: %s", pod.id, where, reason)
        await self._apply(pod, "failed", reason)

    # -- the network ------------------------------------------------------------------------

    def network_pods(self) -> list[PodNet]:
        return self._net.pods(p for p in self._pods.values() if p.state != lc.HIBERNATED)

    async def guest_network(self, pod_id: str) -> NetworkConfig | None:
        """The guest's network configuration, pushed after an attach and a resume."""
        pod = self._pods.get(pod_id)
        return None if pod is None else self._net.guest_config(pod)

    def pods_naming_group(self, group_id: str) -> list[str]:
        return naming(self._pods.values(), group=group_id)

    def pods_naming_table(self, table_id: str) -> list[str]:
        return naming(self._pods.values(), table=table_id)

    # -- the API: create, get, list ---------------------------------------------------------

    @edge(CreatePod)
    async def create_pod(self, req: CreatePod) -> dict[str, Any]:
        self._changes.check()
        now = time.time_ns()
        new = Pod(req.id, req.spec, state=lc.ABSENT, created_ns=now, changed_ns=now,
                  image_layers=req.image_layers, pull_token=req.pull_token)
        pod = await self._change(new, "create", CREATE_S, self._create, acts=_new)
        return {"pod": pod.answer()}

    async def _create(self, pod: Pod) -> Pod:
        async with self._pods_lock:
            found = self._pods.get(pod.id)
            if found is not None:
                if found.spec != pod.spec:
                    raise FeosError(Code.ALREADY_EXISTS, f"pod {pod.id} exists with another spec")
                return found
            await self._claim_and_keep(pod)
        self._net.changed()
        self._spawn_bring_up(pod)
        return pod

    async def _claim_and_keep(self, pod: Pod) -> None:
        self._net.check_can_make(pod)
        volumes = pod.spec.volume_ids()
        await bounded_write(lambda: self._volumes.claim(pod.id, volumes), f"pod {pod.id}'s volumes")
        kept = False
        try:
            await self._net.allocate(pod)
            self._pods[pod.id] = pod
            await self._apply(pod, "create", step="created")
            kept = True
        finally:
            if not kept:
                self._pods.pop(pod.id, None)
                await bounded_write(lambda: self._volumes.release(pod.id),
                                    f"the release of pod {pod.id}'s volumes")

    @edge(PodRef)
    async def get_pod(self, req: PodRef) -> dict[str, Any]:
        pod = self._get(req.id)
        containers = None
        if pod.state == lc.RUNNING:
            containers = await self._container_states(pod)
        return {"pod": pod.answer(containers)}

    async def _container_states(self, pod: Pod) -> list[dict[str, Any]] | None:
        try:
            guest: Guest = await self._vms.guest(pod.id, within=GUEST_S)
            states = await guest.list_containers()
        except FeosError as exc:
            log.debug("pod %s: the containers' states: %s", pod.id, exc)
            return None
        return [container_status(s) for s in states]

    @edge(ListPods)
    async def list_pods(self, req: ListPods) -> dict[str, Any]:
        return {"pods": [p.record() for p in list(self._pods.values())]}

    # -- the API: changes ------------------------------------------------------------------

    @edge(StartPod)
    async def start_pod(self, req: StartPod) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)

        async def start(pod: Pod) -> None:
            if lc.next_state(pod.state, "start", pod.id) == pod.state:
                ended = pod.bringup is None or pod.bringup.done.is_set()
                if pod.state == lc.PENDING and ended:
                    self._spawn_bring_up(pod)  # one that a failed stop ended
                return
            self._net.check_named(pod)
            pod.pull_token = req.pull_token
            await self._apply(pod, "start", step="start")
            self._spawn_bring_up(pod)

        return await self._change(pod, "start", START_S, answered(start))

    @edge(PodRef)
    async def stop_pod(self, req: PodRef) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)
        return await self._change(pod, "stop", STOP_S, answered(self._stop), end_bringup=True)

    async def _stop(self, pod: Pod) -> None:
        if lc.next_state(pod.state, "stop", pod.id) == pod.state:
            return
        await self._stop_vm(pod)
        await self.disks.stop(self._disk_ids(pod))
        await self._apply(pod, "stop", "stopped by a call")

    async def _stop_vm(self, pod: Pod) -> None:
        info = self._vm(pod.id)
        if info is None:
            return
        if info.state is VmState.RUNNING:
            try:
                await self._vms.shutdown(pod.id, grace=SHUTDOWN_GRACE_S)
                return
            except FeosError as exc:
                if exc.busy:
                    raise
                log.warning("pod %s: its microVM did not shut down (%s): removed", pod.id, exc)
        if info.state is VmState.BUSY:
            raise FeosError(Code.UNAVAILABLE, f"the VM is busy: {info.reason}", busy=True)
        if info.state is not VmState.STOPPED:
            await self._vms.delete(pod.id)

    @edge(PodRef)
    async def delete_pod(self, req: PodRef) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)
        await self._change(pod, "delete", DELETE_S, self._delete, end_bringup=True)
        self.events.publish(pod.id, pod.state, deleted=True, reason="deleted")
        self._net.changed()
        return {}

    async def _delete(self, pod: Pod) -> None:
        lc.next_state(pod.state, "delete", pod.id)
        await self._vms.delete(pod.id)
        await self._net.remove(pod)
        await self.disks.stop(pod.spec.volume_ids())  # the volumes stay, their disks stopped
        await self.disks.delete(pod.id, pod_disk(self.state_dir, pod.id))
        await bounded_write(lambda: self._volumes.release(pod.id),
                            f"the release of pod {pod.id}'s volumes")
        async with self._pods_lock:
            # Out of the pods and its record's removal asked for in one step: no save of
            # the pod can land behind the removal.
            del self._pods[pod.id]
            removed = False
            try:
                await bounded_write(lambda: self._records.remove(pod.id),
                                    f"the removal of pod {pod.id}'s record")
                removed = True
            finally:
                if not removed:
                    self._pods[pod.id] = pod

    @edge(PodRef)
    async def suspend_pod(self, req: PodRef) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)
        return await self._change(pod, "suspend", suspend_s(pod.spec.memory_mib),
                                  answered(self._suspend))

    async def _suspend(self, pod: Pod) -> None:
        if lc.next_state(pod.state, "suspend", pod.id) == pod.state:
            return
        await self._vms.suspend(pod.id)
        await self.disks.stop(self._disk_ids(pod))
        await self._apply(pod, "suspend")

    @edge(PodRef)
    async def resume_pod(self, req: PodRef) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)
        progress = pod.hibernation
        if isinstance(progress, Progress) and progress.abandonable:
            await self._hib.abandon(pod, progress)  # the resume below gets the lock after it
        deadline = RESTORE_S if pod.state == lc.HIBERNATED or progress else RESUME_S
        return await self._change(pod, "resume", deadline, answered(self._resume))

    # -- the API: hibernate and restore (feos.pods._hibernate) -----------------------------

    @edge(HibernatePod)
    async def hibernate_pod(self, req: HibernatePod) -> dict[str, Any]:
        self._changes.check()
        pod = self._get(req.id)
        change = pod.hibernating
        if change is None or change.done.is_set():
            progress = Progress(no_abandon=req.no_abandon)

            async def hibernate(pod: Pod) -> dict[str, Any]:
                pod.hibernation = progress
                try:
                    await self._hib.hibernate(pod, progress, suspend=self._suspend,
                                              resume=self._resume)
                finally:
                    pod.hibernation = None
                return {"pod": pod.answer()}

            change = pod.hibernating = self._changes.submit(
                self._new_change(pod, "hibernation", HIBERNATE_S, hibernate))
        return await change.result()

    @edge(RestorePod)
    async def restore_pod(self, req: RestorePod) -> dict[str, Any]:
        """A checkpoint taken over as the pod of its ID (kept), then resumed as a hibernated
        pod of this node's is. A pod of the ID here already: ALREADY_EXISTS."""
        self._changes.check()
        checkpoint = await self._hib.fetch(req.checkpoint)
        if checkpoint.pod_id != req.id:
            raise FeosError(Code.INVALID_ARGUMENT, f"checkpoint {req.checkpoint} is of pod "
                            f"{checkpoint.pod_id}, not {req.id}")  # fmt: skip
        made = parse_spec(checkpoint.spec)
        spec = req.spec or made
        if (spec.vcpus, spec.memory_mib, spec.volume_ids()) != (
                made.vcpus, made.memory_mib, made.volume_ids()):
            raise FeosError(Code.INVALID_ARGUMENT, "spec: its vCPUs, memory and volumes must be "
                            f"the checkpoint's ({made.vcpus}, {made.memory_mib} MiB, "
                            f"{list(made.volume_ids())})")  # fmt: skip
        self._hib.check_runnable(checkpoint)
        now = time.time_ns()
        new = Pod(req.id, spec, state=lc.ABSENT, created_ns=now, changed_ns=now,
                  checkpoint=req.checkpoint)

        async def take(pod: Pod) -> Pod:
            async with self._pods_lock:
                if pod.id in self._pods:
                    raise FeosError(Code.ALREADY_EXISTS, f"pod {pod.id} exists on this node")
                self._net.check_can_make(pod)
                await self._hib.take(pod, checkpoint)
                self._pods[pod.id] = pod
                await self._apply(pod, "take", f"checkpoint {req.checkpoint} taken over")
            return pod

        pod = await self._change(new, "restore", CREATE_S, take, acts=_new)
        try:
            return await self._change(pod, "resume", RESTORE_S, answered(self._resume))
        except FeosError:
            if pod.state == lc.HIBERNATED:  # nothing of it is left half made here
                await self._change(pod, "delete", DELETE_S, self._forget_taken, node=True)
            raise

    async def _forget_taken(self, pod: Pod) -> None:
        await self._delete(pod)
        await self._volumes.forget_checkpointed(pod.id)

    async def hibernations_done(self) -> None:
        """feosd's suspend-on-stop: the hibernations in flight end first (within its grace)."""
        for pod in list(self._pods.values()):
            change = pod.hibernating
            if change is not None:
                await change.done.wait()

    async def _resume(self, pod: Pod) -> None:
        if pod.state == lc.HIBERNATED:
            await self._hib.restore(pod)
            if pod.state == lc.STOPPED:  # a checkpoint of disks alone: the pod boots on them
                await self._apply(pod, "start", step="start")
                self._spawn_bring_up(pod)
                return
        if lc.next_state(pod.state, "resume", pod.id) == pod.state:
            return
        self._net.check_named(pod)
        await self._net.prepare(pod, boot=False)
        await self.disks.start(self._disk_ids(pod), self._vms.driver_for(pod.id))
        await self._vms.resume(pod.id)
        await self._apply(pod, "resume")

    # -- the API: the guest's --------------------------------------------------------------

    async def _running_guest(self, pod_id: str) -> Guest:
        pod = self._get(pod_id)
        if pod.state != lc.RUNNING:
            raise FeosError(Code.FAILED_PRECONDITION, f"pod {pod.id} is {pod.state}, not running")
        guest: Guest = await self._vms.guest(pod.id, within=GUEST_S)
        return guest

    @edge(ExecInPod)
    async def exec_in_pod(self, req: ExecInPod) -> dict[str, Any]:
        guest = await self._running_guest(req.id)
        # by position: GuestHandle.call passes no keywords
        stream = await guest.call(open_exec, guest.client, req.container, list(req.command),
                                  req.environment(), req.tty, req.working_dir, req.rows, req.cols)
        return {"stream": Cap(_schema.pod().ByteStream, stream)}

    @edge(PodLogs)
    async def pod_logs(self, req: PodLogs) -> dict[str, Any]:
        guest = await self._running_guest(req.id)
        stream = await guest.call(open_logs, guest.client, req.container, req.follow)
        return {"stream": Cap(_schema.pod().ByteStream, stream)}

    async def console_log(self, params: dict[str, Any]) -> dict[str, Any]:
        """The microVM's serial console, followed if asked (feos.pods._console)."""
        return await console_log(self, self._vms, params)

    @edge(WatchEvents)
    async def watch_events(self, req: WatchEvents) -> dict[str, Any]:
        watcher = self.events.watch(req.pod_id)
        return {"stream": Cap(_schema.pod().EventStream, watcher)}

    # -- feosd's stop ------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._changes.stopping

    def refuse_changes(self) -> None:
        """The node's stop begins: every call that changes a pod is refused from now on."""
        self._changes.refuse()

    async def finish_changes(self, within: float) -> None:
        """The changes in flight end within `within`, or are cancelled then."""
        await self._changes.finish(within)

    def running(self) -> list[str]:
        return [p.id for p in self._pods.values() if p.state == lc.RUNNING]

    async def suspend_for_stop(self, pod_id: str) -> None:
        pod = self._get(pod_id)
        await self._change(pod, "suspend", suspend_s(pod.spec.memory_mib), self._suspend,
                           node=True)

    async def resume_after_stop(self, pod_id: str) -> None:
        pod = self._get(pod_id)
        await self._change(pod, "resume", RESUME_S, self._resume, node=True)

    def is_suspended(self, pod_id: str) -> bool:
        pod = self._pods.get(pod_id)
        return pod is not None and pod.state == lc.SUSPENDED

    def close(self) -> None:
        self.events.close()
        self._records.close()


def answered(fn: Callable[[Pod], Awaitable[None]]) -> Callable[[Pod], Awaitable[dict[str, Any]]]:
    """The change, answering the pod as it left it (not as a later change made it)."""

    async def change(pod: Pod) -> dict[str, Any]:
        await fn(pod)
        return {"pod": pod.answer()}

    return change


def _new(pod: Pod) -> bool:
    return True  # a create's pod is its own until it is kept


def found(vm: VmInfo | None) -> tuple[str, str]:
    """What a take-over found of a pod's microVM, as the table's event and its reason."""
    if vm is None:
        return "found-gone", "its microVM is gone"
    if vm.state in (VmState.CRASHED, VmState.CREATED):
        return "found-crashed", vm.reason or f"its microVM was {vm.state.value}, not running"
    if vm.state is VmState.STOPPED:
        return "found-stopped", vm.reason
    if vm.state is VmState.SUSPENDED:
        return "found-suspended", "its microVM was suspended"
    if vm.state is VmState.RUNNING:
        return "found-running", ""
    return f"found-{vm.state.value}", ""
