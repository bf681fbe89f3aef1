"""The pods' network as one service: feos.pods' PodNetworkService, implemented.

Theory of operation. `Network.run` does the node's start-up steps (the old networks removed,
forwarding, the prefix unreachable, feos-dns with the resolver's and OTLP's /32s), takes or
binds the resolver's sockets, loads the address allocators past every kept pod's addresses and
writes the table whole; then it serves: the resolver (answering only after `pods_loaded()`), the
metadata server of QEMU pods, the traffic collectors, and the table's loop (a delta on each
`pods_changed()` or group change, the whole table every minute with the node's addresses read
anew). Without --pod-prefix, or when a start-up step fails, it logs why, serves nothing and
`unavailable()` says why; feosd runs on.

Which pods the network knows is a pure function (`known_pods`) of the pod service's view, the
pods `prepare` was given (newer than the view may be) and the pods `remove` took off (until the
view no longer lists them). What the resolver reads on every query, the pod by its IPv4 address
and the name tables, are dicts replaced whole or a read-only view of the store: a lookup never
waits for a write. Everything here runs on trio's thread; netlink, nft and fsync go to workers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError, invalid

from ._addresses import Ipv4Allocator, Ipv6Allocator
from ._contract import GuestNetwork, Link, PodNet, PodsView
from ._dnscache import AnswerCache
from ._dnsresolver import PodDns, QueryRecord
from ._dnsserver import DnsServer
from ._dnsupstream import validate_upstreams
from ._groups import validate_pod_groups
from ._links import (
    TapSpec,
    delete_tap,
    ensure_sysctl,
    guest_mac,
    in_thread,
    make_tap,
    netns_entered,
    prepare_node,
    tap_name,
)
from ._listenfds import DnsSockets, bind_dns_sockets
from ._mesh import Mesh
from ._metadata_server import MetadataServer
from ._mmds import validate_metadata
from ._nametable import NameTable, is_label
from ._nft import METADATA_ADDRESS
from ._options import Addr, NetworkOptions
from ._ports import (
    already_held,
    families,
    holder_of_port,
    open_proc_net,
    overlaps,
    own_socket_inodes,
    read_listeners,
)
from ._relay import Relays
from ._service_model import (
    MeshFacts,
    StoreMapping,
    compile_for,
    dns_pods,
    dns_record,
    guest_network_of,
    known_pods,
    metadata_of,
    missing_reason,
    pod_addresses,
    pod_links,
    read_node_addresses,
    relay_targets,
    remove_old_devices,
    store_of,
    tap_or_none,
)
from ._table import NftLoader, TableWriter
from ._traffic import PodDirectory, RecordHub, TrafficCollector, delete_conntrack
from ._traffic import enable_accounting as _enable_accounting
from ._traffic_service import TrafficService

log = logging.getLogger(__name__)

TABLE_INTERVAL = 60.0
STARTING_REASON = "the pods' network is still starting"
MESH_WAIT_REASON = "the node has no prefix of its mesh yet: the control plane has not given it one"
EXCLUDED_REASON = ("the cluster is meshed and the node has --pod-prefix: the two exclude each "
                   "other, so pods with a network fail; start feosd without --pod-prefix")
OLD_IPV4_COUNTER = "next-address"
OLD_NAT64_MAPS = Path("/sys/fs/bpf/feos/nat64")


# --- the service ----------------------------------------------------------------------------


class Network:
    """The pods' network (feos.pods' PodNetworkService)."""

    def __init__(self, options: NetworkOptions, state_dir: Path, pods: PodsView,
                 groups_store: Any, tables_store: Any, *, netns: str | None = None,
                 dns_sockets: DnsSockets | None = None,
                 table_interval: float = TABLE_INTERVAL, mesh: Mesh | None = None) -> None:
        self.options = options
        self.mesh = mesh
        self.pods_dir = Path(state_dir) / "pods"
        self.view = pods
        self.groups = store_of(groups_store)
        self.tables = store_of(tables_store)
        self.netns = netns
        self.dns_sockets = dns_sockets
        self.table_interval = table_interval
        self.hub = RecordHub()
        self.directory = PodDirectory()
        self.traffic = TrafficService(self.hub, self.unavailable)
        self._reason: str | None = options.unavailable_reason or STARTING_REASON
        self._v6: Ipv6Allocator | None = None
        self._v4: Ipv4Allocator | None = None
        self._alloc_lock = trio.Lock()
        self._table_lock = trio.Lock()
        self._loader: NftLoader | None = None
        self._writer: TableWriter | None = None
        self._wake_send, self._wake_receive = trio.open_memory_channel[None](1)
        self._loaded = trio.Event()
        self._dns: DnsServer | None = None
        self._dns_pods: dict[ipaddress.IPv4Address, PodDns] = {}
        self._metadata = MetadataServer(netns=netns)
        self._prepared: dict[str, PodNet] = {}
        self._removed: set[str] = set()
        self._ifindex: dict[str, int] = {}
        self._node_addresses: tuple[Addr, ...] = ()
        self._directory_ids: set[str] = set()
        self._tables_view: Mapping[str, NameTable] = StoreMapping(self.tables)
        self._proc_net: dict[str, int] = {}
        self.relays = Relays(netns)
        self._chain_group_changes(groups_store)

    def _chain_group_changes(self, groups_store: Any) -> None:
        # SecurityGroupService calls on_change after a put or delete is kept: the table follows.
        before = getattr(groups_store, "on_change", None)
        if before is None:
            return

        def changed() -> None:
            before()
            self.pods_changed()

        groups_store.on_change = changed

    # --- PodNetworkService --------------------------------------------------------------------

    def unavailable(self) -> str | None:
        return self._reason

    def check_spec(self, pod: PodNet) -> None:
        self._require()
        validate_pod_groups(list(pod.security_groups), "spec.network.security_groups")
        for i, t in enumerate(pod.name_tables):
            if not is_label(t):
                raise invalid(f"spec.network.name_tables[{i}]", "must be one lowercase DNS label")
        o = self.options
        validate_upstreams(list(pod.dns_upstreams), resolver=o.dns_address,
                           denied=o.deny_prefixes, pod_prefix=o.pod_prefix,
                           pod_ipv4_range=o.ipv4_range, node_addresses=self._node_addresses)
        try:
            spec = json.loads(pod.metadata_json) if pod.metadata_json else {}
        except ValueError as e:
            raise invalid("spec.metadata", f"must be JSON ({e})") from None
        validate_metadata(spec)
        self._check_published(pod)

    def _check_published(self, pod: PodNet) -> None:
        """Each publish: on an address of the node that is no service of feosd's, and on a port
        no other pod publishes and no socket of the node holds (ALREADY_EXISTS naming it)."""
        others = [(o.id, q) for o in self._known() if o.id != pod.id for q in o.published]
        listeners = read_listeners(self._proc_net) if pod.published else []
        own = own_socket_inodes() if pod.published else set()
        for i, port in enumerate(pod.published):
            where = f"spec.network.publish[{i}]"
            check_host_address(port.host_address, f"{where}.hostAddress", self.options,
                               self._node_addresses)
            for other_id, q in others:
                if overlaps(port, q):
                    raise already_held(where, port, f"pod {other_id} publishes {q.text()}")
            holder = holder_of_port(port, listeners, own)
            if holder is not None:
                raise already_held(where, port, holder)

    async def allocate(self, pod: PodNet) -> PodNet:
        self._require()
        v6, v4 = pod_addresses(pod, self.options)
        async with self._alloc_lock:
            if v6 is None:
                v6 = await trio.to_thread.run_sync(self._allocators()[0].allocate)
            if v4 is None:
                v4 = await trio.to_thread.run_sync(self._allocators()[1].allocate)
        self._removed.discard(pod.id)
        return attrs.evolve(pod, ipv6=str(v6), ipv4=str(v4))

    async def prepare(self, pod: PodNet) -> Link:
        self._require()
        reason = missing_reason(pod, self.groups, self.tables)
        if reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION, reason)
        v6, v4 = pod_addresses(pod, self.options)
        if v6 is None or v4 is None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pod {pod.id} has no addresses of this network: allocate first")
        tap = tap_name(pod.id)
        qemu = pod.driver == "qemu"
        spec = TapSpec(tap, v6, v4, self.options.dns_address, self.options.otlp_address,
                       owner_uid=pod.tap_owner_uid, metadata=qemu)
        self._ifindex[tap] = await make_tap(spec, self.netns)
        if any(4 in families(p.host_address) for p in pod.published):
            await in_thread(self.netns, _route_localnet, tap)
        self._removed.discard(pod.id)
        self._prepared[pod.id] = pod
        self._refresh()
        await self._write_table(full=False, raise_errors=True)
        if qemu:
            await self._metadata.add_pod(tap, metadata_of(pod))
        else:
            self._metadata.remove_pod(tap)
        return Link(tap, guest_mac(pod.id))

    def guest_network(self, pod: PodNet) -> GuestNetwork:
        return guest_network_of(pod, self.options, meshed=self.mesh is not None)

    async def remove(self, pod: PodNet) -> None:
        tap = tap_or_none(pod.id)
        self._removed.add(pod.id)
        self._prepared.pop(pod.id, None)
        self._refresh()  # off the resolver; the traffic records name it by its addresses a while
        if self._reason is not None:
            return  # nothing of it was set up here
        if tap is not None:
            self._metadata.remove_pod(tap)
            await delete_tap(tap, self.netns)
            self._ifindex.pop(tap, None)
        v6, v4 = pod_addresses(pod, self.options)
        addrs = [a for a in (v6, v4) if a is not None]
        if addrs:
            await delete_conntrack(addrs, self.netns)
        await self._write_table(full=False, raise_errors=True)
        if v4 is not None:
            async with self._alloc_lock:
                await trio.to_thread.run_sync(self._allocators()[1].release, v4)

    def pods_changed(self) -> None:
        self._refresh()
        with contextlib.suppress(trio.WouldBlock):
            self._wake_send.send_nowait(None)  # one pending wakeup covers every change since

    def pods_loaded(self) -> None:
        """The pod service went through its pods (kept pods have their addresses): the resolver
        answers from now on, running pods get their metadata service back."""
        self._loaded.set()

    # --- run ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False  # told already: the network comes up after feosd's start (the mesh)
        up = False
        try:
            if self.mesh is not None:
                started = await self._mesh_prefix(task_status)
            if self.options.pod_prefix is None:
                log.warning("%s", self._reason)
            else:
                await self._start()
                up = True
        except (FeosError, OSError) as e:
            why = e.message if isinstance(e, FeosError) else str(e)
            self._reason = f"the pods' network could not be set up: {why}"
            log.error("%s", self._reason)
        if not up:  # no network: feosd runs on
            if not started:
                task_status.started()
            return
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._metadata.serve)
                await nursery.start(self.relays.run)
                assert self._dns is not None
                await nursery.start(self._dns.serve)
                await nursery.start(self._collect)
                nursery.start_soon(self._table_loop)
                nursery.start_soon(self._when_loaded)
                self._reason = None
                log.info("the pods' network is up (%s, %s)", self.options.pod_prefix,
                         self.options.ipv4_range)
                if not started:
                    task_status.started()
                else:  # the pod service catches up: addresses, TAPs, the guests' network
                    catch_up = getattr(self.view, "network_up", None)
                    if catch_up is not None:
                        nursery.start_soon(catch_up)
        finally:
            self._reason = "the pods' network stopped"
            if self._loader is not None:
                self._loader.close()
            for fd in self._proc_net.values():
                os.close(fd)
            self._proc_net = {}

    async def _mesh_prefix(self, task_status: trio.TaskStatus[None]) -> bool:
        """The mesh set up, its /96 the pod prefix; without one yet, feosd goes on (True: the
        task's start was told) while the network waits for JoinMesh's answer."""
        assert self.mesh is not None
        try:
            await self.mesh.start()
        except (FeosError, OSError) as e:
            why = e.message if isinstance(e, FeosError) else str(e)
            self.mesh.reason = f"the mesh could not be set up: {why}"
            raise FeosError(Code.UNAVAILABLE, self.mesh.reason) from None
        self.mesh.on_change = self.pods_changed
        told = False
        if not self.mesh.prefix_given.is_set():
            self._reason = MESH_WAIT_REASON
            log.warning("%s", self._reason)
            task_status.started()
            told = True
            await self.mesh.prefix_given.wait()
        self.options = attrs.evolve(self.options, pod_prefix=self.mesh.prefix)
        return told

    def mesh_excluded(self) -> None:
        """The cluster is meshed and the node has --pod-prefix: its pods fail with a network."""
        self._reason = EXCLUDED_REASON
        log.error("%s", EXCLUDED_REASON)

    async def _start(self) -> None:
        await trio.to_thread.run_sync(lambda: self.pods_dir.mkdir(parents=True, exist_ok=True))
        await self._remove_old_network()
        await prepare_node(self.options, self.netns)
        if self.dns_sockets is None:
            self.dns_sockets = await trio.to_thread.run_sync(
                _bind_in, self.netns, self.options.dns_address)
        kept = known_pods(self.view.network_pods(), {}, ())
        self._v6, self._v4 = await trio.to_thread.run_sync(self._load_allocators, kept)
        self._node_addresses = await in_thread(self.netns, read_node_addresses)
        self._proc_net = await in_thread(self.netns, lambda _: open_proc_net())
        self._loader = NftLoader(self.netns)
        self._writer = TableWriter(self._loader)
        self._refresh()
        await self._write_table(full=True, raise_errors=True)
        await self._enable_accounting()
        self._dns = DnsServer(self.dns_sockets, pod_for=self._dns_pods_get,
                              name_tables=lambda: self._tables_view,
                              on_record=self._on_dns_record,
                              on_records=self._on_dns_records,
                              default_upstreams=tuple(self.options.dns_upstreams),
                              cache=AnswerCache())

    def _load_allocators(self, kept: Sequence[PodNet]) -> tuple[Ipv6Allocator, Ipv4Allocator]:
        prefix = self.options.require_network()
        held = [pod_addresses(p, self.options) for p in kept]
        try:
            v6 = Ipv6Allocator(self.pods_dir, prefix, [a for a, _ in held if a is not None])
            v4 = Ipv4Allocator(self.pods_dir, self.options.ipv4_range,
                               [b for _, b in held if b is not None])
        except OSError as e:
            raise FeosError(Code.UNAVAILABLE, f"the address files in {self.pods_dir}: {e}") from e
        return v6, v4

    async def _remove_old_network(self) -> None:
        """What the first version (a bridge) and the NAT64 version left; every part optional."""
        try:
            gone = await in_thread(self.netns, remove_old_devices)
        except Exception as e:  # pyroute2's errors: a leftover we cannot remove is only logged
            log.warning("the old pods' network's devices: %s", e)
            gone = []
        loader = NftLoader(self.netns)
        try:
            await loader.run("list table bridge feos")
            await loader.run("delete table bridge feos")
            gone.append("table bridge feos")
        except FeosError:
            pass  # none there, or a kernel without the bridge family, which has none
        finally:
            loader.close()
        gone += await trio.to_thread.run_sync(_remove_old_files, self.pods_dir, self.netns)
        if gone:
            log.info("removed what older pods' networks left: %s", ", ".join(gone))

    async def _enable_accounting(self) -> None:
        try:
            await trio.to_thread.run_sync(_enable_accounting, self.netns)
        except FeosError as e:
            log.warning("traffic records: %s", e.message)

    async def _collect(self, *, task_status: trio.TaskStatus[None]) -> None:
        """The conntrack and nflog collectors; without them the network serves on, unrecorded."""
        self.directory.resolver = {self.options.dns_address}
        started = False
        try:
            collector = TrafficCollector(self.hub, self.directory, self.netns)

            async def ready_is_ours(*, task_status: trio.TaskStatus[None]) -> None:
                await collector.run(task_status=task_status)

            async with trio.open_nursery() as nursery:
                await nursery.start(ready_is_ours)
                started = True
                task_status.started()
        except (OSError, FeosError) as e:
            log.error("traffic records: the collectors stopped: %s", e)
            if not started:
                task_status.started()

    async def _when_loaded(self) -> None:
        await self._loaded.wait()
        try:
            links = await in_thread(self.netns, pod_links)
        except Exception as e:  # pyroute2's errors: drops then name pods by address alone
            log.warning("the pods' TAP devices could not be read: %s", e)
            links = {}
        self._ifindex.update(links)
        self._refresh()
        for pod in self._known():
            tap = tap_or_none(pod.id)
            if tap in links and any(4 in families(p.host_address) for p in pod.published):
                await in_thread(self.netns, _route_localnet, tap)  # a TAP an older feosd made
            if pod.driver == "qemu" and tap in links:
                try:
                    await self._metadata.add_pod(tap, metadata_of(pod))  # a running pod's again
                except FeosError as e:
                    log.warning("pod %s's metadata service: %s", pod.id, e.message)
        assert self._dns is not None
        self._dns.pods_loaded()
        self.pods_changed()

    async def _table_loop(self) -> None:
        while True:
            with trio.move_on_after(self.table_interval) as scope:
                await self._wake_receive.receive()
            full = scope.cancelled_caught
            if full:  # every minute: the node's addresses anew, and the table whole
                with contextlib.suppress(Exception):
                    self._node_addresses = await in_thread(self.netns, read_node_addresses)
            try:
                await self._write_table(full=full, raise_errors=False)
            except Exception:  # a bug in a write must not end the pods' network
                log.exception("the pods' table was not written")

    async def _write_table(self, *, full: bool, raise_errors: bool) -> None:
        assert self._writer is not None
        async with self._table_lock:
            try:
                known = self._known()
                table = compile_for(known, self.options, dict(self.groups.items()),
                                    self._node_addresses, self._mesh_facts())
                await self._writer.write(table, full=full)
                await self.relays.sync(relay_targets(known, self.options))
            except FeosError as e:
                if raise_errors:
                    raise
                log.error("the pods' table was not written: %s", e)

    # --- the mesh -----------------------------------------------------------------------------

    async def take_mesh(self, answer: Mapping[str, Any]) -> None:
        """JoinMesh's answer (the uplink's): the mesh takes it; with --pod-prefix the pods fail."""
        if not answer.get("meshed"):
            return
        if self.mesh is None:
            if self.options.pod_prefix is not None:
                self.mesh_excluded()
            return
        await self.mesh.take_join(answer)

    def _mesh_facts(self) -> MeshFacts:
        if self.mesh is None or self.mesh.state.ula is None:
            return MeshFacts()
        return MeshFacts(self.mesh.endpoints(), self.mesh.state.ula)

    # --- the views ----------------------------------------------------------------------------

    def _known(self) -> list[PodNet]:
        view = self.view.network_pods()
        listed = {p.id for p in view}
        self._removed &= listed  # a pod the view no longer lists needs no reminder
        return known_pods(view, self._prepared, self._removed)

    def _refresh(self) -> None:
        """The resolver's pods and the traffic records' directory, from the pods known now."""
        pods = self._known()
        self._dns_pods = dns_pods(pods, self.options)  # replaced whole: lookups never see a mix
        known = {p.id for p in pods}
        for pod_id in [p for p in list(self._directory_ids) if p not in known]:
            self.directory.remove(pod_id)
        for pod in pods:
            v6, v4 = pod_addresses(pod, self.options)
            tap = tap_or_none(pod.id)
            self.directory.add(pod.id, [a for a in (v4, v6) if a is not None], tap,
                               self._ifindex.get(tap) if tap else None)
        self._directory_ids = known

    def _dns_pods_get(self, address: ipaddress.IPv4Address) -> PodDns | None:
        return self._dns_pods.get(address)

    def _on_dns_record(self, q: QueryRecord) -> None:
        self.hub.publish(dns_record(q))

    def _on_dns_records(self, batch: list[QueryRecord]) -> None:
        """A UDP batch's records: made into traffic records only while someone watches (the
        conversion would cost each cached answer about as much as the resolver's own work)."""
        if not self.hub.watched:
            self.hub.lost = 0  # as a publish to no one would have
            return
        for q in batch:
            self.hub.publish(dns_record(q))

    def _require(self) -> None:
        if self._reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION, self._reason)

    def _allocators(self) -> tuple[Ipv6Allocator, Ipv4Allocator]:
        if self._v6 is None or self._v4 is None:
            raise FeosError(Code.FAILED_PRECONDITION, self._reason or STARTING_REASON)
        return self._v6, self._v4


def check_host_address(text: str, where: str, options: NetworkOptions,
                       node_addresses: Sequence[Addr]) -> None:
    """A publish's host address: none of feosd's own services', and one of the node's."""
    if not text or text in ("0.0.0.0", "::"):
        return
    addr = ipaddress.ip_address(text)
    named: dict[Addr, str] = {options.dns_address: "the resolver's address (--dns-address)",
             options.otlp_address: "the OTLP collector's address",
             METADATA_ADDRESS: "the metadata address"}
    if addr in named:
        raise invalid(where, f"{addr} is {named[addr]}: it is never published")
    if not addr.is_loopback and addr not in node_addresses:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"{where}: {addr} is not an address of this node")


def _route_localnet(_: Any, tap: str) -> None:
    """127.0.0.1 DNATed to the pod may leave by its TAP, and the replies come back by it."""
    ensure_sysctl(f"net.ipv4.conf.{tap.replace('.', '/')}.route_localnet", "1")


def _remove_old_files(pods_dir: Path, netns: str | None) -> list[str]:
    """The NAT64 version's IPv4 counter, and its pinned maps (the node's own, not a test's)."""
    gone = []
    old = pods_dir / OLD_IPV4_COUNTER
    if old.exists():
        old.unlink()
        gone.append(str(old))
    if netns is None and OLD_NAT64_MAPS.exists():
        shutil.rmtree(OLD_NAT64_MAPS, ignore_errors=True)
        gone.append(str(OLD_NAT64_MAPS))
    return gone


def _bind_in(netns: str | None, address: ipaddress.IPv4Address) -> DnsSockets:
    with netns_entered(netns):
        return bind_dns_sockets(address)
