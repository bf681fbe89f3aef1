"""The mesh: feos-mesh, its routes, its peers (feos.network MeshService), kept in mesh.pb.

Theory of operation. A node with --control-plane and without --pod-prefix is on its cluster's
mesh. At the start `Mesh.start` reads mesh.pb and the private key (made once, 32 random bytes,
<node dir>/mesh/key, 0600), makes or adopts the device (feos.net._wireguard), sets it up (MTU
1420, no addresses, no router advertisements, up), routes the ULA to it and removes what an
earlier prefix left, and gives the device the kept peers: what differs from what the device has.
JoinMesh's answer (`take_join`, from the uplink) brings the ULA and the node's prefix; the first
one the node gets is its pod prefix (`prefix`, `prefix_given`), a later other one takes effect at
the next start. The peers' changes (`put_mesh_peers`, `update_mesh_peers`) are checked whole
before anything changes, kept (`MeshStore`: a put in mesh.pb written whole, an update as one
synced entry of mesh.pb's journal, replayed at the next start), then given to the device;
`on_change` tells the table (the peers' endpoints are denied to pods). One change at a time
(`_lock`); GetMesh reads the state, which is replaced whole.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

from .. import _schema
from .._journal import Entry, Journal, entry_size
from ..records import write_whole
from . import _mesh_model as model
from ._links import ensure_sysctl, in_thread
from ._mesh_model import MeshState, Peer, PeerChanges
from ._wireguard import DEVICE, MTU, DevicePeer, WgDevice, choose_device

log = logging.getLogger(__name__)

RTN_UNREACHABLE = 7
MAIN_TABLE = 254
NOT_MESHED = "the node is not on a mesh (it has --pod-prefix, or no --control-plane)"


def mesh_key(path: Path) -> tuple[bytes, bytes]:
    """(private, public) of the mesh's key: made once, 32 random bytes, kept base64 in `path`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        raw = base64.b64decode(path.read_text().strip())
    except FileNotFoundError:
        raw = os.getrandom(32)
        write_whole(path, base64.b64encode(raw) + b"\n")
    os.chmod(path, 0o600)
    key = x25519.X25519PrivateKey.from_private_bytes(raw)
    public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                           serialization.PublicFormat.Raw)
    return raw, public


def load_state(path: Path) -> MeshState:
    """mesh.pb alone (without its journal: `MeshStore.open` reads both)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return MeshState()
    with _schema.network().Mesh.from_bytes(data) as reader:
        return model.state_from_dict(reader.to_dict())


def encode_state(state: MeshState) -> bytes:
    """mesh.pb's bytes; built field by field (pycapnp's dict form takes ~6x as long)."""
    msg = _schema.network().Mesh.new_message(
        ula=str(state.ula or ""), nodePrefix=str(state.node_prefix or ""),
        publicKey=state.public_key, port=state.port, version=state.version)
    peers = msg.init("peers", len(state.peers))
    for i, peer in enumerate(state.peers):
        entry = peers[i]
        entry.publicKey, (entry.endpoint, entry.prefix) = peer.public_key, peer.texts
    return bytes(msg.to_bytes())


def keep_state(path: Path, state: MeshState) -> None:
    """mesh.pb written whole (synced, renamed into place, its directory synced)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_whole(path, encode_state(state))


@attrs.frozen
class KeptUpdate:
    """One UpdateMeshPeers as the journal holds it (a feos.network MeshUpdate)."""

    from_version: int
    to_version: int
    put: tuple[Peer, ...]
    remove: tuple[bytes, ...]

    def encode(self) -> bytes:
        msg = _schema.network().MeshUpdate.new_message(fromVersion=self.from_version,
                                                       toVersion=self.to_version)
        entries = msg.init("put", len(self.put))
        for i, peer in enumerate(self.put):
            entry = entries[i]
            entry.publicKey, (entry.endpoint, entry.prefix) = peer.public_key, peer.texts
        keys = msg.init("remove", len(self.remove))
        for i, key in enumerate(self.remove):
            keys[i] = key
        return bytes(msg.to_bytes())

    @classmethod
    def decode(cls, data: bytes) -> KeptUpdate:
        with _schema.network().MeshUpdate.from_bytes(data) as reader:
            d = reader.to_dict()
        return cls(int(d.get("fromVersion", 0)), int(d.get("toVersion", 0)),
                   model.parse_peers(d.get("put", []), "mesh journal's put"),
                   tuple(bytes(k) for k in d.get("remove", [])))


UPDATE = "update"  # the journal's entries' name
JOURNAL_CAPACITY = 256 << 10
FOLD_AT = 64 << 10
"""Bytes of updates in the journal after which the next one folds them into mesh.pb whole."""


class MeshStore:
    """mesh.pb and its journal, <mesh dir>/.journal (feos._journal), used under the mesh's lock
    on worker threads. A put or a join writes mesh.pb whole and then starts the journal's next
    generation; an update is one entry appended to the journal and synced (one fdatasync of
    blocks the file has: no metadata), its encoding its own peers' alone, until FOLD_AT bytes of
    them, when mesh.pb is written whole instead. `open` reads mesh.pb and replays the journal's
    updates in order: one from the version reached is applied, any other is older than mesh.pb
    (a whole write that a crash kept from starting the next generation) and passed over; what
    was replayed is then folded into mesh.pb."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / "mesh.pb"
        self._journal: Journal | None = None

    def open(self) -> MeshState:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.close()
        state = load_state(self.path)
        found = Journal.recover_or_set_aside(self.directory, os.fdatasync, "the mesh")
        if found is None:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._journal = Journal.make(self.directory, dir_fd, JOURNAL_CAPACITY,
                                             os.fdatasync, os.fsync)
            finally:
                os.close(dir_fd)
            return state
        self._journal, entries = found
        replayed = 0
        for entry in entries:
            if entry.name != UPDATE or entry.data is None:
                continue
            kept = KeptUpdate.decode(entry.data)
            if kept.from_version == state.version and kept.to_version > state.version:
                state = model.replayed(state, kept.to_version, kept.put, kept.remove)
                replayed += 1
        if entries:
            if replayed:
                log.info("the mesh: %d updates replayed from the journal, to version %d",
                         replayed, state.version)
            self.keep(state)
        return state

    def keep(self, state: MeshState) -> None:
        """The state whole: mesh.pb written, then the journal's updates no longer read."""
        keep_state(self.path, state)
        journal = self._journaled()
        if journal.used or journal.broken:
            journal.reset(JOURNAL_CAPACITY)

    def keep_update(self, new: MeshState, update: KeptUpdate) -> None:
        """An update from the state kept before to `new`: appended to the journal, or, once
        the journal holds FOLD_AT bytes (or cannot take it), `new` kept whole."""
        journal = self._journaled()
        data = update.encode()
        size = entry_size(UPDATE, data)
        if journal.used + size > FOLD_AT or not journal.fits(size):
            self.keep(new)
            return
        journal.append([Entry(UPDATE, data)])

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def _journaled(self) -> Journal:
        if self._journal is None:
            raise FeosError(Code.FAILED_PRECONDITION, "the mesh's store is not open")
        return self._journal


def device_changes(have: tuple[DevicePeer, ...], want: tuple[Peer, ...]) -> PeerChanges:
    """What the device lacks of `want`, and the peers it has beyond it."""
    present = {p.public_key: p for p in have}
    wanted = {p.public_key for p in want}
    setting = tuple(p for p in want if p.public_key not in present
                    or present[p.public_key].endpoint != p.endpoint_text()
                    or present[p.public_key].allowed != (p.prefix_text(),))
    return PeerChanges(tuple(sorted(k for k in present if k not in wanted)), setting)


class Mesh:
    """The node's part of its cluster's mesh."""

    def __init__(self, mesh_dir: Path, run_dir: Path, port: int, *, netns: str | None = None,
                 device: WgDevice | None = None) -> None:
        self.store = MeshStore(Path(mesh_dir))
        self.path = self.store.path
        self.key_path = Path(mesh_dir) / "key"
        self.port = port
        self.netns = netns
        self.device = device or choose_device(Path(run_dir) / "mesh", netns)
        self.state = MeshState()
        self.prefix: ipaddress.IPv6Network | None = None  # what the network was set up with
        self.prefix_given = trio.Event()
        self.on_change: Callable[[], None] = lambda: None
        self.reason: str | None = "the mesh is starting"
        self._lock = trio.Lock()

    @property
    def kind(self) -> str:
        return self.device.kind

    def endpoints(self) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
        return tuple(sorted({p.endpoint[0] for p in self.state.peers}, key=str))

    async def start(self) -> None:
        async with self._lock:
            state = await trio.to_thread.run_sync(self.store.open)
            private, public = await trio.to_thread.run_sync(mesh_key, self.key_path)
            self.state = attrs.evolve(state, public_key=public, port=self.port)
            await trio.to_thread.run_sync(self.device.ensure, private, self.port)
            await in_thread(self.netns, prepare_link)
            if self.state.ula is not None and self.state.node_prefix is not None:
                await in_thread(self.netns, set_routes, self.state.ula, self.state.node_prefix)
                self.prefix = self.state.node_prefix
                self.prefix_given.set()
            have = await trio.to_thread.run_sync(self.device.read)
            await trio.to_thread.run_sync(self.device.apply,
                                          device_changes(have.peers, self.state.peers))
            self.reason = None
        log.info("the mesh: %s on port %d, %d peers at version %d", self.kind, self.port,
                 len(self.state.peers), self.state.version)

    async def take_join(self, answer: Mapping[str, Any]) -> None:
        """JoinMesh's answer: kept, and the first prefix the network's from now on."""
        async with self._lock:
            state = model.joined(self.state, {**answer, "publicKey": self.state.public_key,
                                              "port": self.port})
            if state != self.state:
                await trio.to_thread.run_sync(self.store.keep, state)
                self.state = state
            if self.prefix is None and state.ula is not None and state.node_prefix is not None:
                await in_thread(self.netns, set_routes, state.ula, state.node_prefix)
                self.prefix = state.node_prefix
                self.prefix_given.set()
            elif state.node_prefix != self.prefix:
                log.warning("the mesh: the node's prefix is now %s; it takes effect at the next "
                            "start (the network runs with %s)", state.node_prefix, self.prefix)

    # --- MeshService ------------------------------------------------------------------------

    async def put_mesh_peers(self, params: dict[str, Any]) -> dict[str, Any]:
        peers = model.parse_peers(params.get("peers", []), "peers")
        version = int(params.get("version", 0))
        async with self._lock:
            self._ready()
            new = model.put(self.state, version, peers)  # every check before anything changes
            await self._keep_and_apply(lambda: self.store.keep(new), new,
                                       model.changes(self.state.peers, new.peers))
        self.on_change()
        return {}

    async def update_mesh_peers(self, params: dict[str, Any]) -> dict[str, Any]:
        put = model.parse_peers(params.get("put", []), "put")
        remove = [bytes(k) for k in params.get("remove", [])]
        from_version = int(params.get("fromVersion", 0))
        to_version = int(params.get("toVersion", 0))
        async with self._lock:
            self._ready()
            new = model.update(self.state, from_version, to_version, put, remove)
            kept = KeptUpdate(from_version, to_version, put, tuple(remove))
            await self._keep_and_apply(lambda: self.store.keep_update(new, kept), new,
                                       model.update_changes(self.state, put, remove))
        self.on_change()
        return {}

    async def get_mesh(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"mesh": model.state_to_dict(self.state)}

    def _ready(self) -> None:
        if self.reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION, self.reason)

    async def _keep_and_apply(self, keep: Callable[[], None], new: MeshState,
                              changes: PeerChanges) -> None:
        """`new` kept, then the device told what changed, on one trip to a worker thread (on a
        busy machine each trip waits for the scheduler); `new` is the state once it is kept,
        whether the device took the change or not (the next start gives it again)."""
        kept = False

        def work() -> None:
            nonlocal kept
            keep()
            kept = True
            self.device.apply(changes)

        try:
            await trio.to_thread.run_sync(work)
        finally:
            if kept:
                self.state = new

    def close(self) -> None:
        self.device.close()
        self.store.close()


class NoMesh:
    """MeshService on a node that is not on a mesh: nothing to show, nothing to change."""

    kind = ""
    reason = NOT_MESHED

    async def put_mesh_peers(self, params: dict[str, Any]) -> dict[str, Any]:
        raise FeosError(Code.FAILED_PRECONDITION, NOT_MESHED)

    async def update_mesh_peers(self, params: dict[str, Any]) -> dict[str, Any]:
        raise FeosError(Code.FAILED_PRECONDITION, NOT_MESHED)

    async def get_mesh(self, params: dict[str, Any]) -> dict[str, Any]:
        raise FeosError(Code.FAILED_PRECONDITION, NOT_MESHED)


# --- the link and its routes (sync, on a worker thread with an IPRoute: _links.in_thread) ------


def prepare_link(ipr: Any) -> None:
    """feos-mesh: no router advertisements, no addresses of its own, MTU 1420, up."""
    index = _index(ipr)
    for key, value in (("accept_ra", "0"), ("addr_gen_mode", "1"), ("autoconf", "0")):
        ensure_sysctl(f"net.ipv6.conf.{DEVICE}.{key}", value)
    ipr.link("set", index=index, mtu=MTU, state="up")
    for addr in ipr.get_addr(index=index):
        ipr.addr("del", index=index, address=addr.get_attr("IFA_ADDRESS"),
                 prefixlen=addr["prefixlen"])


def set_routes(ipr: Any, ula: ipaddress.IPv6Network, own: ipaddress.IPv6Network) -> None:
    """The ULA to feos-mesh (MTU 1420); what an earlier prefix left removed: the main table's
    other routes to feos-mesh, the unreachable ones in the ULA's /48 but the node's own."""
    index = _index(ipr)
    ipr.route("replace", dst=str(ula), oif=index, family=socket.AF_INET6,
              metrics={"mtu": MTU})
    global_id = ula.supernet(new_prefix=48) if ula.prefixlen > 48 else ula
    for route in ipr.get_routes(family=socket.AF_INET6, table=MAIN_TABLE):
        dst = ipaddress.IPv6Network(f"{route.get_attr('RTA_DST') or '::'}/{route['dst_len']}")
        to_mesh = route.get_attr("RTA_OIF") == index and dst != ula
        stale = (route["type"] == RTN_UNREACHABLE and dst.subnet_of(global_id) and dst != own
                 and dst != ula)
        if to_mesh or stale:
            log.info("the mesh: removed the route for %s an earlier prefix left", dst)
            ipr.route("del", dst=str(dst), family=socket.AF_INET6, type=route["type"],
                      table=MAIN_TABLE, **({"oif": index} if to_mesh else {}))


def _index(ipr: Any) -> int:
    found = ipr.link_lookup(ifname=DEVICE)
    if not found:
        raise FeosError(Code.UNAVAILABLE, f"the mesh's device {DEVICE} is not there")
    return int(found[0])
