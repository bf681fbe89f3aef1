"""The mesh: feos-mesh, its routes, its peers (feos.network MeshService), kept in mesh.pb.

Theory of operation. A node with --control-plane and without --pod-prefix is on its cluster's
mesh. At the start `Mesh.start` reads mesh.pb and the private key (made once, 32 random bytes,
<node dir>/mesh/key, 0600), makes or adopts the device (feos.net._wireguard), sets it up (MTU
1420, no addresses, no router advertisements, up), routes the ULA to it and removes what an
earlier prefix left, and gives the device the kept peers: what differs from what the device has.
JoinMesh's answer (`take_join`, from the uplink) brings the ULA and the node's prefix; the first
one the node gets is its pod prefix (`prefix`, `prefix_given`), a later other one takes effect at
the next start. The peers' changes (`put_mesh_peers`, `update_mesh_peers`) are checked whole
before anything changes, kept in mesh.pb, then given to the device; `on_change` tells the table
(the peers' endpoints are denied to pods). One change at a time (`_lock`); GetMesh reads the
state, which is replaced whole.
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
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return MeshState()
    with _schema.network().Mesh.from_bytes(data) as reader:
        return model.state_from_dict(reader.to_dict())


def keep_state(path: Path, state: MeshState) -> None:
    """mesh.pb written whole; built field by field (pycapnp's dict form takes ~6x as long)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    msg = _schema.network().Mesh.new_message(
        ula=str(state.ula or ""), nodePrefix=str(state.node_prefix or ""),
        publicKey=state.public_key, port=state.port, version=state.version)
    peers = msg.init("peers", len(state.peers))
    for i, peer in enumerate(state.peers):
        entry = peers[i]
        entry.publicKey, (entry.endpoint, entry.prefix) = peer.public_key, peer.texts
    write_whole(path, msg.to_bytes())


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
        self.path = Path(mesh_dir) / "mesh.pb"
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
            state = await trio.to_thread.run_sync(load_state, self.path)
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
                await trio.to_thread.run_sync(keep_state, self.path, state)
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
        await self._change(lambda s: model.put(s, int(params.get("version", 0)), peers))
        return {}

    async def update_mesh_peers(self, params: dict[str, Any]) -> dict[str, Any]:
        put = model.parse_peers(params.get("put", []), "put")
        remove = [bytes(k) for k in params.get("remove", [])]
        await self._change(lambda s: model.update(s, int(params.get("fromVersion", 0)),
                                                  int(params.get("toVersion", 0)), put, remove))
        return {}

    async def get_mesh(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"mesh": model.state_to_dict(self.state)}

    async def _change(self, step: Callable[[MeshState], MeshState]) -> None:
        async with self._lock:
            if self.reason is not None:
                raise FeosError(Code.FAILED_PRECONDITION, self.reason)
            new = step(self.state)  # every check before anything changes
            await trio.to_thread.run_sync(keep_state, self.path, new)
            old, self.state = self.state, new
            await trio.to_thread.run_sync(self.device.apply,
                                          model.changes(old.peers, new.peers))
        self.on_change()

    def close(self) -> None:
        self.device.close()


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
