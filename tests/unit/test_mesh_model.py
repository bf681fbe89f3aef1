"""The mesh's pure part: the peers' checks, put and update with their versions, the changes the
device is given, and mesh.pb's round trip (feos.net._mesh_model)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net import _mesh_model as m

ULA = ipaddress.IPv6Network("fd12:3456:789a:1::/64")
OWN = ipaddress.IPv6Network("fd12:3456:789a:1:0:1::/96")
STATE = m.MeshState(ula=ULA, node_prefix=OWN, public_key=b"\x01" * 32, port=51820)


def peer(n: int, endpoint: str = "192.0.2.{n}:51820", prefix: str | None = None) -> m.Peer:
    return m.parse_peer({"publicKey": bytes([n + 1]) * 32, "endpoint": endpoint.format(n=n),
                         "prefix": prefix or f"fd12:3456:789a:1:0:{n + 1:x}::/96"}, "peers[0]")


def refused(code: Code, *words: str):  # type: ignore[no-untyped-def]
    class Check:
        def __enter__(self) -> None:
            return None

        def __exit__(self, kind, exc, tb) -> bool:  # type: ignore[no-untyped-def]
            assert isinstance(exc, FeosError), f"not refused: {exc!r}"
            assert exc.code == code, exc
            for w in words:
                assert w in exc.message, exc.message
            return True

    return Check()


def test_put_replaces_whole_and_sorts() -> None:
    state = m.put(STATE, 3, [peer(3), peer(2)])
    assert state.version == 3
    assert [p.public_key[0] for p in state.peers] == [3, 4]
    assert m.put(state, 3, [peer(2), peer(3)]) == state  # the same version again, unchanged


def test_put_older_or_same_version_with_other_peers_refused() -> None:
    state = m.put(STATE, 3, [peer(2)])
    with refused(Code.FAILED_PRECONDITION, "older"):
        m.put(state, 2, [peer(2)])
    with refused(Code.FAILED_PRECONDITION, "other peers"):
        m.put(state, 3, [peer(3)])


def test_update_from_the_nodes_version_only() -> None:
    state = m.put(STATE, 3, [peer(2), peer(3)])
    with refused(Code.FAILED_PRECONDITION, "from_version 2", "version 3"):
        m.update(state, 2, 4, [peer(4)], [])
    with refused(Code.INVALID_ARGUMENT, "to_version"):
        m.update(state, 3, 3, [peer(4)], [])
    after = m.update(state, 3, 4, [peer(4)], [peer(2).public_key])
    assert after.version == 4
    assert {p.public_key[0] for p in after.peers} == {4, 5}


def test_update_removing_an_unknown_peer_refused() -> None:
    state = m.put(STATE, 1, [peer(2)])
    with refused(Code.FAILED_PRECONDITION, "remove[0]"):
        m.update(state, 1, 2, [], [b"\x09" * 32])


@pytest.mark.parametrize(("data", "words"), [
    ({"publicKey": b"short", "endpoint": "192.0.2.1:1", "prefix": "fd12:3456:789a:1:0:2::/96"},
     ["peers[0].public_key", "32 bytes"]),
    ({"publicKey": b"k" * 32, "endpoint": "192.0.2.1", "prefix": "fd12:3456:789a:1:0:2::/96"},
     ["peers[0].endpoint", "ADDRESS:PORT"]),
    ({"publicKey": b"k" * 32, "endpoint": "host:51820", "prefix": "fd12:3456:789a:1:0:2::/96"},
     ["peers[0].endpoint", "not an IP address"]),
    ({"publicKey": b"k" * 32, "endpoint": "fd00::1:51820", "prefix": "fd12:3456:789a:1:0:2::/96"},
     ["brackets"]),
    ({"publicKey": b"k" * 32, "endpoint": "192.0.2.1:70000", "prefix": "fd12:3456:789a:1:0:2::/96"},
     ["ADDRESS:PORT"]),
    ({"publicKey": b"k" * 32, "endpoint": "192.0.2.1:1", "prefix": "fd12:3456:789a:1::/80"},
     ["peers[0].prefix", "/64 or /96"]),
    ({"publicKey": b"k" * 32, "endpoint": "192.0.2.1:1", "prefix": "fd12:3456:789a:1:0:2::1/96"},
     ["host bits"]),
])
def test_a_bad_peer_names_its_field(data: dict[str, object], words: list[str]) -> None:
    with refused(Code.INVALID_ARGUMENT, *words):
        m.parse_peers([data], "peers")


def test_prefixes_inside_the_ula_and_apart() -> None:
    outside = peer(2, prefix="fd99::/96")
    with refused(Code.INVALID_ARGUMENT, "outside the cluster's ULA"):
        m.put(STATE, 1, [outside])
    with refused(Code.INVALID_ARGUMENT, "overlaps the node's own prefix"):
        m.put(STATE, 1, [peer(2, prefix=str(OWN))])
    wide = peer(3, prefix="fd12:3456:789a:1::/64")  # a /64 peer holds every /96
    with refused(Code.INVALID_ARGUMENT, "overlaps"):
        m.put(STATE, 1, [wide])
    with refused(Code.INVALID_ARGUMENT, "peers[1].prefix", "overlaps"):
        m.put(STATE, 1, [peer(2), peer(3, prefix=str(peer(2).prefix))])
    with refused(Code.INVALID_ARGUMENT, "peers[1].public_key", "same key"):
        m.put(STATE, 1, [peer(2), peer(2, prefix="fd12:3456:789a:1:0:9::/96")])
    with refused(Code.INVALID_ARGUMENT, "node's own key"):
        m.put(STATE, 1, [m.Peer(STATE.public_key, peer(2).endpoint, peer(2).prefix)])
    kept = m.put(STATE, 1, [peer(2), peer(3)])
    with refused(Code.INVALID_ARGUMENT, "put[1].prefix", f"the node's peer {peer(3).key_text()}'s "
                 f"{peer(3).prefix}"):
        m.update(kept, 1, 2, [peer(4), peer(5, prefix=str(peer(3).prefix))], [])


def test_peers_of_a_48_mesh_may_be_64s() -> None:
    old = m.MeshState(ula=ipaddress.IPv6Network("fd12:3456:789a::/48"),
                      node_prefix=ipaddress.IPv6Network("fd12:3456:789a:1::/64"))
    state = m.put(old, 1, [peer(2, prefix="fd12:3456:789a:2::/64")])
    assert state.peers[0].prefix.prefixlen == 64


def test_no_peers_before_the_join() -> None:
    with refused(Code.FAILED_PRECONDITION, "JoinMesh"):
        m.put(m.MeshState(), 1, [peer(2)])


def test_joined_checks_the_answer() -> None:
    got = m.joined(m.MeshState(), {"ula": str(ULA), "prefix": str(OWN)})
    assert (got.ula, got.node_prefix) == (ULA, OWN)
    with refused(Code.INVALID_ARGUMENT, "outside"):
        m.joined(m.MeshState(), {"ula": str(ULA), "prefix": "fd12:3456:789a:2:0:1::/96"})
    with refused(Code.INVALID_ARGUMENT, "unique local"):
        m.joined(m.MeshState(), {"ula": "2001:db8::/64", "prefix": "2001:db8::/96"})


def test_changes_leave_a_peer_that_stays_alone() -> None:
    a, b, c = peer(2), peer(3), peer(4)
    moved = peer(3, endpoint="198.51.100.7:51820")
    got = m.changes([a, b, c], [a, moved])
    assert got.remove == (c.public_key,)
    assert got.set == (moved,)
    assert not m.changes([a, b], [b, a])


@given(st.sets(st.integers(0, 40)), st.sets(st.integers(0, 40)))
def test_changes_take_old_to_new(old: set[int], new: set[int]) -> None:
    before = {n: peer(n) for n in old}
    after = {n: peer(n, endpoint="203.0.113.{n}:1") if n % 3 == 0 else peer(n) for n in new}
    got = m.changes(before.values(), after.values())
    result = {p.public_key: p for p in before.values()}
    for k in got.remove:
        del result[k]
    result.update((p.public_key, p) for p in got.set)
    assert result == {p.public_key: p for p in after.values()}
    assert all(p not in before.values() for p in got.set)  # only what is new or changed


def test_state_round_trip() -> None:
    state = m.put(STATE, 7, [peer(2), peer(3, endpoint="[2001:db8::3]:51821")])
    assert m.state_from_dict(m.state_to_dict(state)) == state
    assert state.peers[1].endpoint_text() == "[2001:db8::3]:51821"


@given(st.lists(st.tuples(st.sampled_from([64, 96]), st.integers(0, 6)), max_size=12))
def test_overlaps_found_as_pairwise_would(picks: list[tuple[int, int]]) -> None:
    wide = m.MeshState(ula=ipaddress.IPv6Network("fd12:3456:789a::/48"),
                       node_prefix=ipaddress.IPv6Network("fd12:3456:789a:1:0:1::/96"))
    nets = [ipaddress.IPv6Network((int(wide.ula.network_address) + (n << 64 if ln == 64 else
                                                                     (1 << 64) + (n << 32)), ln))
            for ln, n in picks]
    peers = [m.Peer(bytes([i + 2]) * 32, peer(0).endpoint, net) for i, net in enumerate(nets)]
    everything = [*nets, wide.node_prefix]
    pairwise = any(a.overlaps(b) for i, a in enumerate(everything) for b in everything[i + 1:])
    try:
        m.check_peers(wide, peers, "peers")
        found = False
    except FeosError as e:
        assert e.code == Code.INVALID_ARGUMENT and "overlaps" in e.message
        found = True
    assert found == pairwise


@given(st.dictionaries(st.integers(1, 20), st.integers(0, 2)),
       st.dictionaries(st.integers(1, 20), st.integers(0, 2)), st.sets(st.integers(1, 20)))
def test_an_updates_changes_are_those_of_its_states(old: dict[int, int], put: dict[int, int],
                                                    remove: set[int]) -> None:
    state = m.put(STATE, 1, [peer(n, f"192.0.2.{n}:{51820 + p}") for n, p in old.items()])
    putting = [peer(n, f"192.0.2.{n}:{51820 + p}") for n, p in put.items()]
    gone = [bytes([n + 1]) * 32 for n in remove if n in old]
    new = m.update(state, 1, 2, putting, gone)
    assert m.update_changes(state, putting, gone) == m.changes(state.peers, new.peers)
    assert m.replayed(state, 2, putting, gone) == new


@given(st.lists(st.tuples(st.sampled_from([64, 96]), st.integers(0, 5)), max_size=8),
       st.lists(st.tuples(st.integers(0, 9), st.sampled_from([64, 96]), st.integers(0, 5)),
                max_size=4),
       st.sets(st.integers(0, 9)))
def test_an_update_refused_as_the_whole_list_check_would(
        kept: list[tuple[int, int]], put: list[tuple[int, int, int]], remove: set[int]) -> None:
    """update's check (its peers, each bisected into the kept ones) against check_peers over
    the kept peers and the update's together; a /48 ULA, so that /64 peers may hold /96 ones."""
    wide = m.MeshState(ula=ipaddress.IPv6Network("fd12:3456:789a::/48"),
                       node_prefix=ipaddress.IPv6Network("fd12:3456:789a:1:0:1::/96"),
                       public_key=b"\x01" * 32)

    def net(ln: int, n: int) -> ipaddress.IPv6Network:
        base = int(wide.ula.network_address)  # type: ignore[union-attr]
        return ipaddress.IPv6Network((base + (n << 64 if ln == 64 else (1 << 64) + (n << 32)), ln))

    def keyed(k: int, ln: int, n: int) -> m.Peer:
        return m.Peer(bytes([k + 2]) * 32, peer(0).endpoint, net(ln, n))

    apart, taken = [], []
    for k, (ln, n) in enumerate(kept):  # the kept peers passed once: only those apart
        p = keyed(k, ln, n)
        if not any(p.prefix.overlaps(q) for q in [*taken, wide.node_prefix]):
            apart.append(p)
            taken.append(p.prefix)
    state = m.put(wide, 1, apart)
    putting = [keyed(k, ln, n) for k, ln, n in put]
    gone = [bytes([k + 2]) * 32 for k in sorted(remove) if k < len(kept)
            and bytes([k + 2]) * 32 in state.peer_map()]
    left = [p for p in state.peers if p.public_key not in gone
            and p.public_key not in {q.public_key for q in putting}]
    try:
        m.check_peers(wide, [*left, *putting], "peers")
        whole: Code | None = None
    except FeosError as e:
        whole = e.code
    try:
        new = m.update(state, 1, 2, putting, gone)
        got: Code | None = None
    except FeosError as e:
        assert "put[" in e.message, e.message
        got = e.code
    assert got == whole
    if got is None:
        assert new.peers == m.put(wide, 2, [*left, *putting]).peers
        assert new.index() == m.PeerIndex.of(new.peers)  # carried over as made afresh
