"""vms.db: the ID's encoding (UUID as 16 bytes, short ID as text) and records that round-trip."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.vmm._driver import VmSpec, VmState
from feos.vmm._records import Records, VmRecord, check_id, decode_id, encode_id

CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
short_ids = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from([c for c in CROCKFORD if c.isalpha()]),
    st.text(alphabet=CROCKFORD, min_size=10, max_size=10),
)


@given(short_ids)
def test_short_id_is_text(vm_id: str) -> None:
    assert encode_id(vm_id) == vm_id
    assert decode_id(vm_id) == vm_id


@given(st.uuids())
def test_uuid_is_16_bytes(u: uuid.UUID) -> None:
    key = encode_id(str(u))
    assert isinstance(key, bytes)
    assert len(key) == 16
    assert decode_id(key) == str(u)


@pytest.mark.parametrize(
    "bad", ["", "0bcdefghjkm", "abcdefghjki", "abcdefghjk", "ABCDEFGHJKM",
            "22222222-3333-4444-5555-66666666666G", "../../etc/passwd"],
)  # fmt: skip
def test_other_ids_are_refused(bad: str) -> None:
    with pytest.raises(FeosError) as e:
        check_id(bad)
    assert e.value.code == Code.INVALID_ARGUMENT


@given(st.text(max_size=40))
def test_check_id_never_crashes(text: str) -> None:
    try:
        got: object = check_id(text)
    except FeosError as e:
        got = e.code
    assert got in (text, Code.INVALID_ARGUMENT)


def _record(vm_id: str, state: VmState = VmState.RUNNING) -> VmRecord:
    spec = VmSpec(vcpus=2, memory_mib=768, data_disk="/d/data.img", volumes=("/v/1", "/v/2"),
                  tap="pod-abc", mac="06:00:01:02:03:04", metadata='{"a": 1}')  # fmt: skip
    return VmRecord(vm_id, "qemu", state, "why", "0123456789ab", "tcg", spec, 2000001)


def test_store_round_trip(tmp_path: Path) -> None:
    store = Records(tmp_path / "vms.db")
    a, b = _record("abcdefghjkm"), _record("22222222-3333-4444-5555-666666666666")
    store.put(a)
    store.put(b)
    store.put(_record("abcdefghjkm", VmState.SUSPENDED))
    store.close()
    again = Records(tmp_path / "vms.db")
    got = {r.id: r for r in again.all()}
    assert got == {a.id: _record(a.id, VmState.SUSPENDED), b.id: b}
    again.remove(a.id)
    assert [r.id for r in again.all()] == [b.id]
    again.close()
    rows = sqlite3.connect(tmp_path / "vms.db").execute("SELECT typeof(id), id FROM vms").fetchall()
    assert rows == [("blob", uuid.UUID(b.id).bytes)]
