"""The mesh's pure part: what mesh.pb holds, the peers' checks, and their changes (node.md).

Theory of operation. `MeshState` is what the node knows of its cluster's mesh: the ULA and the
node's prefix (JoinMesh's answer), the WireGuard port and public key, the version of the peers and
the peers. The control plane changes the peers in two ways: `put` replaces them whole with a
version (an older version than the node's is refused, the same one only with the same peers),
`update` goes from the node's version to a later one by putting and removing peers (from any
other version: FAILED_PRECONDITION). Every peer is checked before anything changes: a key of 32
bytes, an endpoint ADDRESS:PORT, a prefix of /64 or /96 inside the ULA, none overlapping another
or the node's own. `changes` says what the device must do to go from one set of peers to the
next: remove those that went, set those that are new or changed; a peer that stays is left alone
and keeps its session. An update costs its own peers' work, not the kept peers': the state
carries a `PeerIndex` (by key, by address) from one update to the next, against which an update's
peers are checked (a bisection each) and from copies of which the next one is made;
`update_changes` gives the device's changes from the update alone.
"""

from __future__ import annotations

import base64
import bisect
import ipaddress
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import attrs

from feos.errors import Code, FeosError, invalid

IPv6Net = ipaddress.IPv6Network
PEER_LENGTHS = (64, 96)
ULA_LENGTHS = (48, 64)
NODE_LENGTHS = (64, 96)
ULA = IPv6Net("fc00::/7")


@attrs.frozen
class Peer:
    public_key: bytes
    endpoint: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
    prefix: IPv6Net
    # Made once: what the checks compare (the prefix's first and last address) and what the
    # record and the device are given; ipaddress's str() of an IPv6 prefix costs ~50 us.
    first: int = attrs.field(init=False, eq=False, repr=False)
    last: int = attrs.field(init=False, eq=False, repr=False)
    texts: tuple[str, str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        addr, port = self.endpoint
        endpoint = f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
        object.__setattr__(self, "first", int(self.prefix.network_address))
        object.__setattr__(self, "last", int(self.prefix.broadcast_address))
        object.__setattr__(self, "texts", (endpoint, str(self.prefix)))

    def endpoint_text(self) -> str:
        return self.texts[0]

    def prefix_text(self) -> str:
        return self.texts[1]

    def key_text(self) -> str:
        return base64.b64encode(self.public_key).decode()


@attrs.frozen
class MeshState:
    ula: IPv6Net | None = None
    node_prefix: IPv6Net | None = None
    public_key: bytes = b""
    port: int = 0
    version: int = 0
    peers: tuple[Peer, ...] = ()
    # The peers by key and by address, made by `put` and carried from state to state by
    # `update` (else made when first asked for): an update then looks at its own peers alone.
    _index: PeerIndex | None = attrs.field(init=False, default=None, eq=False, repr=False)

    def index(self) -> PeerIndex:
        if self._index is None:
            object.__setattr__(self, "_index", PeerIndex.of(self.peers))
        assert self._index is not None
        return self._index

    def peer_map(self) -> dict[bytes, Peer]:
        return self.index().by_key


@attrs.frozen
class PeerIndex:
    """A state's peers: by key, sorted by key (as `MeshState.peers`), and their prefixes sorted
    by their first address (apart, so sorted by their last too). Not changed once made: `updated`
    makes the next one from copies (C's list and dict copies; the Python work is the update's
    peers' alone)."""

    by_key: dict[bytes, Peer]
    keys: list[bytes]
    peers: list[Peer]
    firsts: list[int]
    spans: list[tuple[int, int, bytes]]  # (first, last, key), in the order of `firsts`

    @classmethod
    def of(cls, peers: Iterable[Peer]) -> PeerIndex:
        ordered = sorted(peers, key=lambda p: p.public_key)
        spans = sorted((p.first, p.last, p.public_key) for p in ordered)
        return cls({p.public_key: p for p in ordered}, [p.public_key for p in ordered], ordered,
                   [first for first, _, _ in spans], spans)

    def overlapping(self, peer: Peer, passed: Container[bytes]) -> Peer | None:
        """A peer here whose prefix overlaps `peer`'s, but for those keyed in `passed`."""
        i = bisect.bisect_right(self.firsts, peer.last) - 1
        while i >= 0 and self.spans[i][1] >= peer.first:
            if self.spans[i][2] not in passed:
                return self.by_key[self.spans[i][2]]
            i -= 1
        return None

    def updated(self, put_peers: Iterable[Peer], remove: Iterable[bytes]) -> PeerIndex:
        by_key, keys, peers = dict(self.by_key), list(self.keys), list(self.peers)
        firsts, spans = list(self.firsts), list(self.spans)

        def drop(key: bytes) -> None:
            old = by_key.pop(key)
            i = bisect.bisect_left(keys, key)
            del keys[i], peers[i]
            j = bisect.bisect_left(firsts, old.first)
            del firsts[j], spans[j]

        put_peers = tuple(put_peers)
        for key in (*remove, *(p.public_key for p in put_peers)):  # all out before any goes in:
            if key in by_key:  # two that swap prefixes would share a first address meanwhile
                drop(key)
        for peer in put_peers:
            by_key[peer.public_key] = peer
            i = bisect.bisect_left(keys, peer.public_key)
            keys.insert(i, peer.public_key)
            peers.insert(i, peer)
            j = bisect.bisect_left(firsts, peer.first)
            firsts.insert(j, peer.first)
            spans.insert(j, (peer.first, peer.last, peer.public_key))
        return PeerIndex(by_key, keys, peers, firsts, spans)


@attrs.frozen
class PeerChanges:
    """What the device is told: these keys removed, these peers set (endpoint, one prefix)."""

    remove: tuple[bytes, ...] = ()
    set: tuple[Peer, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.remove or self.set)


# --- parsing ----------------------------------------------------------------------------------


def parse_endpoint(text: str, field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address,
                                                   int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise invalid(field, f"{text!r} is not ADDRESS:PORT ([ADDRESS]:PORT for IPv6)")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        addr = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise invalid(field, f"{text!r}: {host!r} is not an IP address") from None
    if addr.version == 6 and not bracketed:
        raise invalid(field, f"{text!r}: an IPv6 address goes in brackets")
    if addr.is_unspecified or addr.is_multicast:
        raise invalid(field, f"{text!r}: not an address a peer listens on")
    return addr, int(port)


def parse_prefix(text: str, field: str, lengths: Sequence[int]) -> IPv6Net:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise invalid(field, f"{text!r} is not a prefix without host bits ({e})") from None
    if not isinstance(net, IPv6Net) or net.prefixlen not in lengths:
        raise invalid(field, f"{text!r} must be an IPv6 /{' or /'.join(map(str, lengths))}")
    return net


def parse_key(value: Any, field: str) -> bytes:
    key = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b""
    if len(key) != 32:
        raise invalid(field, f"a WireGuard public key is 32 bytes, not {len(key)}")
    return key


def parse_peer(data: Mapping[str, Any], field: str) -> Peer:
    return Peer(parse_key(data.get("publicKey", b""), f"{field}.public_key"),
                parse_endpoint(str(data.get("endpoint", "")), f"{field}.endpoint"),
                parse_prefix(str(data.get("prefix", "")), f"{field}.prefix", PEER_LENGTHS))


def parse_peers(items: Iterable[Mapping[str, Any]], field: str) -> tuple[Peer, ...]:
    return tuple(parse_peer(p, f"{field}[{i}]") for i, p in enumerate(items))


def check_peers(state: MeshState, peers: Sequence[Peer], field: str) -> None:
    """Inside the ULA, one per key, no prefix overlapping another's or the node's own."""
    ula = state.ula
    if ula is None:
        raise FeosError(Code.FAILED_PRECONDITION,
                        "the node has no mesh yet: JoinMesh has not answered it")
    low, high = int(ula.network_address), int(ula.broadcast_address)
    seen: dict[bytes, int] = {}
    for i, peer in enumerate(peers):
        where = f"{field}[{i}]"
        if peer.public_key in seen:
            first = seen[peer.public_key]
            raise invalid(f"{where}.public_key", f"the same key as {field}[{first}]")
        seen[peer.public_key] = i
        if peer.public_key == state.public_key:
            raise invalid(f"{where}.public_key", "is the node's own key")
        if not low <= peer.first <= peer.last <= high:
            raise invalid(f"{where}.prefix", f"{peer.prefix} is outside the cluster's ULA {ula}")
    _check_apart(state, peers, field)


def _check_apart(state: MeshState, peers: Sequence[Peer], field: str) -> None:
    """No two prefixes overlap: sorted by their first address, each must begin after the end of
    every one before it (prefixes either hold one another or are apart). The later peer of two
    is named, the node's own prefix (-1) never."""
    named = [(p.first, p.last, i) for i, p in enumerate(peers)]
    if state.node_prefix is not None:
        own = state.node_prefix
        named.append((int(own.network_address), int(own.broadcast_address), -1))
    named.sort()
    widest: tuple[int, int, int] | None = None
    for item in named:
        if widest is not None and item[0] <= widest[1]:
            (_, _, j), (_, _, k) = sorted([widest, item], key=lambda n: n[2])
            whose = ("the node's own prefix " + str(state.node_prefix) if j < 0
                     else f"{field}[{j}]'s {peers[j].prefix}")
            raise invalid(f"{field}[{k}].prefix", f"{peers[k].prefix} overlaps {whose}")
        if widest is None or item[1] > widest[1]:
            widest = item


# --- the changes ------------------------------------------------------------------------------


def put(state: MeshState, version: int, peers: Sequence[Peer]) -> MeshState:
    """The peers whole at `version`: older than the node's refused, the same only unchanged."""
    if version < state.version:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"version {version} is older than the node's {state.version}")
    check_peers(state, peers, "peers")
    if version == state.version and set(peers) != set(state.peers):
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"version {version} is the node's already, with other peers")
    index = PeerIndex.of(peers)
    return _with_index(attrs.evolve(state, version=version, peers=tuple(index.peers)), index)


def update(state: MeshState, from_version: int, to_version: int, put_peers: Sequence[Peer],
           remove: Sequence[bytes]) -> MeshState:
    """From the node's version to a later one: `remove` taken out, `put_peers` set."""
    if from_version != state.version:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"from_version {from_version} is not the node's version {state.version}")
    if to_version <= from_version:
        raise invalid("to_version", f"{to_version} must be later than from_version "
                                    f"{from_version}")
    index = state.index()
    gone: set[bytes] = set()
    for i, key in enumerate(remove):
        key = parse_key(key, f"remove[{i}]")
        if key not in index.by_key or key in gone:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"remove[{i}]: the node has no peer {base64.b64encode(key).decode()}")
        gone.add(key)
    check_peers(state, put_peers, "put")  # among themselves and against the node's own
    passed = gone | {p.public_key for p in put_peers}  # going, or put anew
    for i, peer in enumerate(put_peers):
        other = index.overlapping(peer, passed)
        if other is not None:
            raise invalid(f"put[{i}].prefix", f"{peer.prefix} overlaps the node's peer "
                                              f"{other.key_text()}'s {other.prefix}")
    return replayed(state, to_version, put_peers, gone)


def replayed(state: MeshState, to_version: int, put_peers: Iterable[Peer],
             remove: Iterable[bytes]) -> MeshState:
    """An update kept before applied again (mesh.pb's journal at the start): checked when it was
    kept, so not again; the same state as `update` gave then."""
    index = state.index().updated(put_peers, remove)
    return _with_index(attrs.evolve(state, version=to_version, peers=tuple(index.peers)), index)


def _with_index(state: MeshState, index: PeerIndex) -> MeshState:
    object.__setattr__(state, "_index", index)
    return state


def update_changes(old: MeshState, put_peers: Iterable[Peer],
                   remove: Iterable[bytes]) -> PeerChanges:
    """`changes(old.peers, update(old, ...).peers)` from the update alone: what it removes and
    does not put again, what it puts that differs; the kept peers not looked at."""
    before = old.peer_map()
    putting = {p.public_key: p for p in put_peers}
    gone = tuple(sorted(k for k in set(remove) if k not in putting and k in before))
    setting = tuple(p for k, p in sorted(putting.items()) if before.get(k) != p)
    return PeerChanges(gone, setting)


def changes(old: Iterable[Peer], new: Iterable[Peer]) -> PeerChanges:
    before = {p.public_key: p for p in old}
    after = {p.public_key: p for p in new}
    gone = tuple(sorted(k for k in before if k not in after))
    setting = tuple(p for k, p in sorted(after.items())
                    if before.get(k) is not p and before.get(k) != p)  # kept: the same object
    return PeerChanges(gone, setting)


# --- mesh.pb's dicts --------------------------------------------------------------------------


def state_from_dict(data: Mapping[str, Any]) -> MeshState:
    """mesh.pb as pycapnp's to_dict gives it; a record is trusted as it was checked when kept."""
    ula = data.get("ula") or None
    node = data.get("nodePrefix") or None
    return MeshState(
        ula=parse_prefix(ula, "mesh.ula", ULA_LENGTHS) if ula else None,
        node_prefix=parse_prefix(node, "mesh.node_prefix", NODE_LENGTHS) if node else None,
        public_key=bytes(data.get("publicKey", b"")),
        port=int(data.get("port", 0)),
        version=int(data.get("version", 0)),
        peers=parse_peers(data.get("peers", []), "mesh.peers"),
    )


def peer_to_dict(peer: Peer) -> dict[str, Any]:
    return {"publicKey": peer.public_key, "endpoint": peer.endpoint_text(),
            "prefix": peer.prefix_text()}


def state_to_dict(state: MeshState) -> dict[str, Any]:
    return {"ula": str(state.ula or ""), "nodePrefix": str(state.node_prefix or ""),
            "publicKey": state.public_key, "port": state.port, "version": state.version,
            "peers": [peer_to_dict(p) for p in state.peers]}


def joined(state: MeshState, answer: Mapping[str, Any]) -> MeshState:
    """JoinMesh's answer taken: the ULA and the node's prefix, checked; the peers kept."""
    ula = parse_prefix(str(answer.get("ula", "")), "JoinMesh's ula", ULA_LENGTHS)
    node = parse_prefix(str(answer.get("prefix", "")), "JoinMesh's prefix", NODE_LENGTHS)
    if not ula.subnet_of(ULA):
        raise invalid("JoinMesh's ula", f"{ula} is not a unique local prefix (fc00::/7)")
    if not node.subnet_of(ula):
        raise invalid("JoinMesh's prefix", f"{node} is outside the cluster's ULA {ula}")
    return attrs.evolve(state, ula=ula, node_prefix=node,
                        public_key=bytes(answer.get("publicKey", state.public_key)),
                        port=int(answer.get("port", state.port)))
