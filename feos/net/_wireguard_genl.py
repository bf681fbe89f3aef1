"""The kernel's WireGuard as the mesh's device: WG_CMD_SET_DEVICE over generic netlink.

`genl_set_messages` encodes the messages (the payload after nlmsghdr: genlmsghdr and the
attributes of uapi/linux/wireguard.h), with every peer of a message in one WGDEVICE_A_PEERS
attribute, 32 to a message, as wg(8) splits them; tests/unit/test_mesh_genl.py checks them
against pyroute2's WireGuard encoder. `GenlDevice` sends them and reads the device back with
pyroute2. Not run on the machines this project is tested on: their kernel has no WireGuard.
"""

from __future__ import annotations

import base64
import ipaddress
import socket
import struct
from collections.abc import Iterable
from typing import Any

from feos.errors import Code, FeosError

from ._mesh_model import Peer, PeerChanges
from ._wireguard import DEVICE, DevicePeer, DeviceState

WG_GENL_VERSION = 1
WG_CMD_SET_DEVICE = 1
WGDEVICE_A_IFNAME, WGDEVICE_A_PRIVATE_KEY, WGDEVICE_A_LISTEN_PORT = 2, 3, 6
WGDEVICE_A_PEERS = 8
WGPEER_A_PUBLIC_KEY, WGPEER_A_FLAGS, WGPEER_A_ENDPOINT, WGPEER_A_ALLOWEDIPS = 1, 3, 4, 9
WGALLOWEDIP_A_FAMILY, WGALLOWEDIP_A_IPADDR, WGALLOWEDIP_A_CIDR_MASK = 1, 2, 3
WGPEER_F_REMOVE_ME, WGPEER_F_REPLACE_ALLOWEDIPS = 0x1, 0x2
NLA_F_NESTED = 0x8000
PEERS_PER_MESSAGE = 32  # about 4 KiB a message


def _nla(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _endpoint(peer: Peer) -> bytes:
    addr, port = peer.endpoint
    if isinstance(addr, ipaddress.IPv4Address):
        return struct.pack("=H", socket.AF_INET) + struct.pack(">H", port) + addr.packed + bytes(8)
    return (struct.pack("=H", socket.AF_INET6) + struct.pack(">HI", port, 0) + addr.packed
            + struct.pack(">I", 0))


def _allowed(net: ipaddress.IPv6Network) -> bytes:
    return _nla(NLA_F_NESTED | 1, _nla(WGALLOWEDIP_A_FAMILY, struct.pack("=H", socket.AF_INET6))
                + _nla(WGALLOWEDIP_A_IPADDR, net.network_address.packed)
                + _nla(WGALLOWEDIP_A_CIDR_MASK, struct.pack("=B", net.prefixlen)))


def genl_peer(peer: Peer | bytes) -> bytes:
    """One peer's nested attribute: a key alone with REMOVE_ME, or endpoint and one prefix."""
    if isinstance(peer, bytes):
        body = _nla(WGPEER_A_PUBLIC_KEY, peer) + _nla(WGPEER_A_FLAGS,
                                                      struct.pack("=I", WGPEER_F_REMOVE_ME))
    else:
        body = (_nla(WGPEER_A_PUBLIC_KEY, peer.public_key)
                + _nla(WGPEER_A_ENDPOINT, _endpoint(peer))
                + _nla(WGPEER_A_FLAGS, struct.pack("=I", WGPEER_F_REPLACE_ALLOWEDIPS))
                + _nla(NLA_F_NESTED | WGPEER_A_ALLOWEDIPS, _allowed(peer.prefix)))
    return _nla(NLA_F_NESTED | 1, body)


def genl_set_messages(ifname: str, changes: PeerChanges, *, private_key: bytes | None = None,
                      port: int | None = None) -> list[bytes]:
    """The payloads (genlmsghdr and attributes) of WG_CMD_SET_DEVICE: the key and port in the
    first, the peers in one WGDEVICE_A_PEERS per message, PEERS_PER_MESSAGE at most each."""
    items: list[Peer | bytes] = [*changes.remove, *changes.set]
    chunks = [items[i:i + PEERS_PER_MESSAGE] for i in range(0, len(items), PEERS_PER_MESSAGE)]
    out = []
    for n, chunk in enumerate(chunks or [[]]):
        body = struct.pack("=BBH", WG_CMD_SET_DEVICE, WG_GENL_VERSION, 0)
        body += _nla(WGDEVICE_A_IFNAME, ifname.encode() + b"\0")
        if n == 0 and private_key is not None:
            body += _nla(WGDEVICE_A_PRIVATE_KEY, private_key)
        if n == 0 and port is not None:
            body += _nla(WGDEVICE_A_LISTEN_PORT, struct.pack("=H", port))
        if chunk:
            body += _nla(NLA_F_NESTED | WGDEVICE_A_PEERS, b"".join(genl_peer(p) for p in chunk))
        out.append(body)
    return out


class GenlDevice:
    """The kernel's WireGuard: the link over rtnetlink, its configuration over generic netlink."""

    kind = "kernel (generic netlink)"

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns

    def ensure(self, private_key: bytes, port: int) -> None:
        from pyroute2 import IPRoute  # type: ignore[import-untyped]

        from ._links import netns_entered

        with netns_entered(self.netns), IPRoute() as ipr:
            if not ipr.link_lookup(ifname=DEVICE):
                ipr.link("add", ifname=DEVICE, kind="wireguard")
        self._send(genl_set_messages(DEVICE, PeerChanges(), private_key=private_key, port=port))

    def apply(self, changes: PeerChanges) -> None:
        if changes:
            self._send(genl_set_messages(DEVICE, changes))

    def read(self) -> DeviceState:
        from pyroute2 import WireGuard

        from ._links import netns_entered

        with netns_entered(self.netns):
            wg = WireGuard()
            try:
                msgs = list(wg.info(DEVICE))
            finally:
                wg.close()
        return _genl_state(msgs)

    def close(self) -> None:
        pass

    def _send(self, payloads: Iterable[bytes]) -> None:
        from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST  # type: ignore[import-untyped]
        from pyroute2.netlink.generic import GenericNetlinkSocket  # type: ignore[import-untyped]
        from pyroute2.netlink.generic.wireguard import wgmsg  # type: ignore[import-untyped]

        from ._links import netns_entered

        with netns_entered(self.netns):
            sock = GenericNetlinkSocket()
            try:
                sock.bind("wireguard", wgmsg)
                for seq, payload in enumerate(payloads, 1):
                    header = struct.pack("=IHHII", 16 + len(payload), sock.prid,
                                         NLM_F_REQUEST | NLM_F_ACK, seq, 0)
                    sock.sendto(header + payload, (0, 0))
                    for answer in sock.get():
                        error = answer["header"].get("error")
                        if error is not None:
                            raise FeosError(Code.INTERNAL, f"WireGuard's netlink: {error}")
            finally:
                sock.close()


def _genl_state(msgs: list[Any]) -> DeviceState:
    public, port, peers = b"", 0, []
    for msg in msgs:
        key = msg.get_attr("WGDEVICE_A_PUBLIC_KEY")
        public = base64.b64decode(key["value"]) if key else public
        port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or port
        for peer in msg.get_attr("WGDEVICE_A_PEERS") or []:
            pkey = base64.b64decode(peer.get_attr("WGPEER_A_PUBLIC_KEY")["value"])
            endpoint = peer.get_attr("WGPEER_A_ENDPOINT") or {}
            allowed = tuple(a["addr"] for a in peer.get_attr("WGPEER_A_ALLOWEDIPS") or [])
            hand = peer.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME") or {}
            peers.append(DevicePeer(pkey, f"{endpoint.get('addr', '')}:{endpoint.get('port', '')}",
                                    allowed, int(hand.get("tv_sec", 0)),
                                    int(peer.get_attr("WGPEER_A_RX_BYTES") or 0),
                                    int(peer.get_attr("WGPEER_A_TX_BYTES") or 0)))
    return DeviceState(public, port, tuple(peers))
