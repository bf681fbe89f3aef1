"""mesh.pb and its journal (feos.net._mesh.MeshStore): what random puts, updates and joins kept
is what a reopen reads, through folds, crashes between a whole write and the journal's next
generation, a torn last entry and a broken journal."""

from __future__ import annotations

import ipaddress
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos import _journal
from feos.errors import Code, FeosError
from feos.net import _mesh
from feos.net import _mesh_model as m

ULA = ipaddress.IPv6Network("fd12:3456:789a:1::/64")
OWN = ipaddress.IPv6Network("fd12:3456:789a:1:0:1::/96")
JOINED = m.MeshState(ula=ULA, node_prefix=OWN, public_key=b"\x01" * 32, port=51820)
POOL = 12


def peer(n: int, port: int = 51820) -> m.Peer:
    return m.parse_peer({"publicKey": bytes([n + 2]) * 32, "endpoint": f"192.0.2.{n}:{port}",
                         "prefix": f"fd12:3456:789a:1:0:{n + 2:x}::/96"}, "peers[0]")


peers_st = st.dictionaries(st.integers(0, POOL - 1), st.integers(51820, 51823), max_size=POOL)
op_st = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), peers_st),
    st.tuples(st.just("update"), st.integers(1, 2), peers_st, st.sets(st.integers(0, POOL - 1))),
    st.tuples(st.just("join"), st.integers(0, 1)),
    st.tuples(st.just("whole, crashed before the journal's next generation")),
    st.tuples(st.just("reopen")),
)


def apply(store: _mesh.MeshStore, state: m.MeshState, op: tuple) -> m.MeshState:  # type: ignore[type-arg]
    """One change as the mesh makes it: checked by the model, then kept; the state it is."""
    try:
        return _apply(store, state, op)
    except FeosError as e:  # refused by the model (the same version with other peers): unkept
        assert e.code == Code.FAILED_PRECONDITION and op[0] == "put", e
        return state


def _apply(store: _mesh.MeshStore, state: m.MeshState, op: tuple) -> m.MeshState:  # type: ignore[type-arg]
    kind = op[0]
    if kind == "put":
        new = m.put(state, state.version + op[1], [peer(n, p) for n, p in op[2].items()])
        store.keep(new)
    elif kind == "update":
        present = {p.public_key for p in state.peers}
        remove = [bytes([n + 2]) * 32 for n in sorted(op[3]) if bytes([n + 2]) * 32 in present]
        put = [peer(n, p) for n, p in op[2].items()]
        new = m.update(state, state.version, state.version + op[1], put, remove)
        assert m.replayed(state, new.version, put, remove) == new
        store.keep_update(new, _mesh.KeptUpdate(state.version, new.version, tuple(put),
                                                tuple(remove)))
    elif kind == "join":
        prefix = f"fd12:3456:789a:1:0:{1 + op[1] * 0xff:x}::/96"
        new = m.joined(state, {"ula": str(ULA), "prefix": prefix})
        store.keep(new)
    elif kind == "reopen":
        new = store.open()
    else:  # mesh.pb written whole, the journal's entries still there (a crash then)
        _mesh.keep_state(store.path, state)
        new = store.open()
    return new


@settings(max_examples=40)
@given(st.lists(op_st, max_size=25), st.sampled_from([300, 2000, _mesh.FOLD_AT]))
def test_a_reopen_reads_what_was_kept(ops: list[tuple], fold_at: int) -> None:  # type: ignore[type-arg]
    saved = _mesh.FOLD_AT
    _mesh.FOLD_AT = fold_at
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = _mesh.MeshStore(Path(tmp) / "mesh")
            assert store.open() == m.MeshState()
            store.keep(JOINED)
            state = JOINED
            for op in ops:
                state = apply(store, state, op)
                again = _mesh.MeshStore(store.directory)  # what a restart would read now
                assert again.open() == state, op
                again.close()
            store.close()
    finally:
        _mesh.FOLD_AT = saved


def test_an_update_writes_the_journal_alone(tmp_path: Path) -> None:
    store = _mesh.MeshStore(tmp_path / "mesh")
    store.open()
    state = m.put(JOINED, 1, [peer(n) for n in range(POOL)])
    store.keep(state)
    before = store.path.stat()
    new = m.update(state, 1, 2, [peer(3, 51900)], [peer(4).public_key])
    store.keep_update(new, _mesh.KeptUpdate(1, 2, (peer(3, 51900),), (peer(4).public_key,)))
    after = store.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _mesh.load_state(store.path) == state  # mesh.pb as it was; the journal has the rest
    store.close()
    reopened = _mesh.MeshStore(store.directory)
    assert reopened.open() == new
    assert _mesh.load_state(store.path) == new  # folded at the open
    reopened.close()


def test_a_torn_last_update_is_not_read(tmp_path: Path) -> None:
    store = _mesh.MeshStore(tmp_path / "mesh")
    store.open()
    state = m.put(JOINED, 1, [peer(0), peer(1)])
    store.keep(state)
    first = m.update(state, 1, 2, [peer(2)], [])
    store.keep_update(first, _mesh.KeptUpdate(1, 2, (peer(2),), ()))
    journal = tmp_path / "mesh" / _journal.NAME
    end = _journal.HEAD + len(_journal.encode_entry(1, 1, _journal.Entry(
        _mesh.UPDATE, _mesh.KeptUpdate(1, 2, (peer(2),), ()).encode())))
    second = m.update(first, 2, 3, [], [peer(0).public_key])
    store.keep_update(second, _mesh.KeptUpdate(2, 3, (), (peer(0).public_key,)))
    store.close()
    fd = os.open(journal, os.O_RDWR)
    os.pwrite(fd, b"\xff", end + 20)  # the second entry's write cut by a crash: never answered
    os.close(fd)
    reopened = _mesh.MeshStore(tmp_path / "mesh")
    assert reopened.open() == first
    reopened.close()


def test_a_broken_journal_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _mesh.MeshStore(tmp_path / "mesh")
    store.open()
    state = m.put(JOINED, 1, [peer(0)])
    store.keep(state)
    store.close()
    (tmp_path / "mesh" / _journal.NAME).write_bytes(b"not a journal")
    reopened = _mesh.MeshStore(tmp_path / "mesh")
    assert reopened.open() == state
    assert [p.name.split("-")[0] for p in (tmp_path / "mesh").glob(".journal.broken-*")] == [
        ".journal.broken"]
    assert "holds no valid header" in caplog.text
    reopened.close()
