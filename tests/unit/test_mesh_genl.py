"""The kernel backend's WG_CMD_SET_DEVICE messages against pyroute2's WireGuard encoder, and the
UAPI text of wireguard-go (feos.net._wireguard). The kernel here has no WireGuard: the messages
are what can be checked of the generic-netlink backend (tests/kernel/test_mesh_device.py skips it
and says so)."""

from __future__ import annotations

import base64
import ipaddress
import struct

from hypothesis import given
from hypothesis import strategies as st
from pyroute2.netlink.generic.wireguard import AsyncWireGuard, wgmsg

from feos.net import _wireguard as wg
from feos.net import _wireguard_genl as genl
from feos.net._mesh_model import Peer, PeerChanges

HEADER = 16  # nlmsghdr, which pyroute2 encodes and the backend adds when it sends


def pyroute2_payload(ifname: str, *, private_key: bytes | None = None, port: int | None = None,
                     peer: dict[str, object] | None = None) -> bytes:
    msg = wgmsg()
    msg["cmd"], msg["version"] = genl.WG_CMD_SET_DEVICE, genl.WG_GENL_VERSION
    msg["attrs"].append(["WGDEVICE_A_IFNAME", ifname])
    if private_key is not None:
        msg["attrs"].append(["WGDEVICE_A_PRIVATE_KEY", base64.b64encode(private_key).decode()])
    if port is not None:
        msg["attrs"].append(["WGDEVICE_A_LISTEN_PORT", port])
    if peer is not None:
        AsyncWireGuard._wg_set_peer(object.__new__(AsyncWireGuard), msg, peer)
    msg.encode()
    return bytes(msg.data[HEADER:])


def as_pyroute2(p: Peer | bytes) -> dict[str, object]:
    if isinstance(p, bytes):
        return {"public_key": base64.b64encode(p).decode(), "remove": True}
    addr, port = p.endpoint
    return {"public_key": p.key_text(), "endpoint_addr": str(addr), "endpoint_port": port,
            "replace_allowed_ips": True, "allowed_ips": [str(p.prefix)]}


keys = st.binary(min_size=32, max_size=32)
peers = st.builds(
    Peer, keys,
    st.tuples(st.one_of(st.ip_addresses(v=4).filter(lambda a: not a.is_multicast),
                        st.ip_addresses(v=6).filter(lambda a: not a.is_multicast)),
              st.integers(1, 65535)),
    st.builds(lambda n, ln: ipaddress.IPv6Network((n << (128 - ln), ln)),
              st.integers(0, 2**64 - 1), st.sampled_from([64, 96])).map(
                  lambda net: ipaddress.IPv6Network(
                      (int(net.network_address) & ((2**128 - 1) << (128 - net.prefixlen))
                       & (2**128 - 1), net.prefixlen))))


@given(keys, st.integers(1, 65535))
def test_the_devices_key_and_port_as_pyroute2_encodes_them(key: bytes, port: int) -> None:
    (ours,) = genl.genl_set_messages("feos-mesh", PeerChanges(), private_key=key, port=port)
    assert ours == pyroute2_payload("feos-mesh", private_key=key, port=port)


@given(peers)
def test_a_set_peer_as_pyroute2_encodes_it(peer: Peer) -> None:
    (ours,) = genl.genl_set_messages("feos-mesh", PeerChanges(set=(peer,)))
    assert ours == pyroute2_payload("feos-mesh", peer=as_pyroute2(peer))


@given(keys)
def test_a_removed_peer_as_pyroute2_encodes_it(key: bytes) -> None:
    (ours,) = genl.genl_set_messages("feos-mesh", PeerChanges(remove=(key,)))
    assert ours == pyroute2_payload("feos-mesh", peer=as_pyroute2(key))


def _peers_attribute(payload: bytes) -> bytes:
    at = 4
    while at < len(payload):
        length, kind = struct.unpack_from("=HH", payload, at)
        if kind & 0x3FFF == genl.WGDEVICE_A_PEERS:
            return payload[at + 4:at + length]
        at += (length + 3) & ~3
    raise AssertionError("no WGDEVICE_A_PEERS")


@given(st.lists(peers, min_size=2, max_size=80, unique_by=lambda p: p.public_key))
def test_many_peers_go_in_one_peers_attribute_per_message(many: list[Peer]) -> None:
    """pyroute2 repeats WGDEVICE_A_PEERS per peer, of which the kernel reads the last alone: the
    backend nests them in one, each peer as pyroute2 encodes it, 32 to a message."""
    got = genl.genl_set_messages("feos-mesh", PeerChanges(set=tuple(many)))
    assert len(got) == -(-len(many) // genl.PEERS_PER_MESSAGE)
    nested = b"".join(_peers_attribute(m) for m in got)
    expected = b"".join(_peers_attribute(pyroute2_payload("feos-mesh", peer=as_pyroute2(p)))
                        for p in many)
    assert nested == expected


def test_uapi_set_text() -> None:
    a = Peer(b"\x02" * 32, (ipaddress.ip_address("192.0.2.2"), 51820),
             ipaddress.IPv6Network("fd00:0:0:1:0:2::/96"))
    text = wg.uapi_set(PeerChanges(remove=(b"\x03" * 32,), set=(a,)), private_key=b"\x01" * 32,
                       port=51820)
    assert text == ("set=1\n" f"private_key={'01' * 32}\n" "listen_port=51820\n"
                    f"public_key={'03' * 32}\n" "remove=true\n"
                    f"public_key={'02' * 32}\n" "endpoint=192.0.2.2:51820\n"
                    "replace_allowed_ips=true\n" f"allowed_ip={a.prefix}\n\n")


def test_uapi_get_parsed() -> None:
    private = b"\x05" * 32
    text = (f"private_key={private.hex()}\nlisten_port=51820\n"
            f"public_key={'02' * 32}\nendpoint=[2001:db8::2]:51820\nlast_handshake_time_sec=7\n"
            "rx_bytes=10\ntx_bytes=20\nallowed_ip=fd00::/96\nerrno=0\n\n")
    state = wg.parse_uapi_get(text)
    assert state.port == 51820
    assert state.public_key == wg._public_of(private)
    assert state.peers == (wg.DevicePeer(b"\x02" * 32, "[2001:db8::2]:51820", ("fd00::/96",), 7,
                                         10, 20),)
