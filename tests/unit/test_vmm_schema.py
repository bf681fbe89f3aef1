"""schema/microvm.capnp: it loads, every result starts with a Status, and its states are
feos.vmm's."""

from __future__ import annotations

from pathlib import Path

import capnp

from feos.vmm import VmState

SCHEMA = Path(__file__).resolve().parents[2] / "schema"


def _load() -> object:
    return capnp.load(str(SCHEMA / "microvm.capnp"), imports=[str(SCHEMA)])


def test_states_are_the_layers() -> None:
    m = _load()
    wire = set(m.VmState.schema.enumerants)  # type: ignore[attr-defined]
    assert wire == {s.value for s in VmState if s is not VmState.DELETED}


def test_every_result_starts_with_a_status() -> None:
    service = _load().MicroVmService.schema  # type: ignore[attr-defined]
    for name, method in service.methods.items():
        first = method.result_type.fields_list[0]
        assert first.proto.name == "status", name
        assert first.proto.codeOrder == 0, name
