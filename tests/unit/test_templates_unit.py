"""Pod templates' own logic (feos.pods._templates, _template_api) and the guest's identity parts
(feos.guest._identity) that need no guest: shapes, keys, records, one make per key, a damaged
template found, the entropy's layout. The real restores are integration/test_pods_templates.py's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from feos.errors import Code, FeosError
from feos.guest import _identity
from feos.pods._bringup import identity
from feos.pods._pod import Pod
from feos.pods._spec import parse_spec
from feos.pods._template_api import WarmTemplate
from feos.pods._templates import (
    MEMORY,
    RECORD,
    Shape,
    Template,
    TemplateKey,
    Templates,
    from_record,
    sha256_file,
    shape_of,
)


def _key(**changes: Any) -> TemplateKey:
    fields: dict[str, Any] = dict(guest="g1", vmm="qemu", vmm_version="7.2.15", accel="tcg",
                                  shape=Shape(1, 512, 0, True), drives=1, base="sha256:" + "a" * 64)
    fields.update(changes)
    return TemplateKey(**fields)


def test_a_shape_is_parsed_and_bad_ones_name_the_field() -> None:
    assert Shape.parse("1x512+net") == Shape(1, 512, 0, True)
    assert Shape.parse("2X1024", disk_mib=2048) == Shape(2, 1024, 2048, False)
    for bad in ("1x", "x512", "1x512+wifi", "0x512", "1x32", "one"):
        with pytest.raises(FeosError) as e:
            Shape.parse(bad)
        assert e.value.code is Code.INVALID_ARGUMENT
        assert e.value.message.startswith("shape: ")


def test_the_key_names_everything_the_snapshot_fixes() -> None:
    key = _key()
    assert key.name == _key().name  # the same key, the same name (on any node)
    for change in (dict(guest="g2"), dict(vmm_version="8.0"), dict(accel="kvm"),
                   dict(shape=Shape(2, 512, 0, True)), dict(shape=Shape(1, 512, 0, False)),
                   dict(shape=Shape(1, 512, 2048, True)), dict(drives=2),
                   dict(base="sha256:" + "b" * 64)):
        assert _key(**change).name != key.name, change


def test_a_record_reads_back() -> None:
    template = Template(_key(), "sha256:" + "c" * 64, "sha256:" + "d" * 64, 1 << 20, 5)
    again = from_record(json.loads(json.dumps(template.record())))
    assert again == template
    assert again.answer(Path("/t"))["memoryMib"] == 512


def test_pods_with_volumes_have_no_shape() -> None:
    plain = Pod("pa0000000aa", parse_spec({"vcpus": 2, "memoryMib": 1024}))
    assert shape_of(plain) == Shape(2, 1024, 0, True)
    offline = Pod("pa0000000ab", parse_spec({"network": {"none": None}}))
    assert shape_of(offline) == Shape(1, 512, 0, False)
    with_volume = Pod("pa0000000ac", parse_spec({"volumes": [
        {"name": "v", "volumeId": "11111111-2222-4333-8444-555555555555"}]}))
    assert shape_of(with_volume) is None


def test_warm_template_checks_its_fields() -> None:
    assert WarmTemplate().shape() == Shape(1, 512, 0, False)
    with pytest.raises(FeosError, match="diskSizeMib"):
        WarmTemplate(disk_size_mib=10).shape()
    with pytest.raises(FeosError, match="memoryMib"):
        WarmTemplate(memory_mib=64).shape()


def test_each_pod_gets_its_own_identity() -> None:
    one = identity(Pod("pa0000000aa", parse_spec({})))
    other = identity(Pod("pa0000000ab", parse_spec({"network": {"none": None}})))
    assert one.hostname == "pa0000000aa" and one.mac.startswith("06:00:")
    assert other.mac == ""  # no network device to name
    assert one.machine_id != other.machine_id and len(one.machine_id) == 32
    assert identity(Pod("pa0000000aa", parse_spec({}))).machine_id == one.machine_id
    assert one.entropy != identity(Pod("pa0000000aa", parse_spec({}))).entropy
    assert len(one.entropy) >= 32


def test_the_entropy_is_a_rand_pool_info_credited_at_the_nodes_bytes() -> None:
    seed = bytes(range(64))
    blob = _identity.entropy_of(seed)
    bits, size = struct.unpack_from("=ii", blob)
    assert bits == 8 * len(seed)
    assert size == len(blob) - 8 and blob[8:8 + len(seed)] == seed


def test_a_machine_id_is_32_hex_digits(tmp_path: Path) -> None:
    path = _identity.write_machine_id(str(tmp_path), "0123456789abcdef" * 2)
    assert Path(path).read_text() == "0123456789abcdef" * 2 + "\n"
    for bad in ("", "xyz", "0123456789ABCDEF" * 2, "0" * 31):
        with pytest.raises(FeosError) as e:
            _identity.check_machine_id(bad)
        assert e.value.code is Code.INVALID_ARGUMENT


def test_a_hostname_is_checked_before_it_is_set() -> None:
    for bad in ("", "a b", "x" * 65, "a/b"):
        with pytest.raises(FeosError) as e:
            _identity.set_hostname(bad)
        assert e.value.code is Code.INVALID_ARGUMENT


class _Diskd:
    def __init__(self) -> None:
        self.disks: dict[str, dict[str, Any]] = {}

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]:
        if method == "getDisk":
            if params["id"] not in self.disks:
                raise FeosError(Code.NOT_FOUND, "no disk")
            return {"disk": self.disks[params["id"]]}
        if method == "deleteDisk":
            self.disks.pop(params["id"], None)
            return {}
        raise AssertionError(method)


class _Vms:
    async def delete(self, vm_id: str) -> None:
        pass


def _kept(root: Path, diskd: _Diskd, data: bytes = b"memory") -> tuple[Templates, Template]:
    key = _key()
    d = root / "templates" / key.name
    d.mkdir(parents=True)
    (d / MEMORY).write_bytes(data)
    template = Template(key, "sha256:" + "e" * 64, sha256_file(d / MEMORY), len(data), 1)
    (d / RECORD).write_text(json.dumps(template.record()))
    diskd.disks[key.name] = {"base": template.layer}
    templates = Templates(root, _Vms(), diskd, vmm_version=lambda: "7.2.15")  # type: ignore[arg-type]
    templates._have[key.name] = template
    return templates, template


async def test_a_damaged_template_is_told_apart(tmp_path: Path) -> None:
    diskd = _Diskd()
    templates, template = _kept(tmp_path, diskd)
    assert await templates._damage(template) == ""
    memory = templates.memory(template)
    memory.write_bytes(b"MEMORY")  # same size, another digest
    assert "digest" in await templates._damage(template)
    memory.write_bytes(b"memory")
    assert await templates._damage(template) == ""
    diskd.disks[template.name] = {"base": "sha256:" + "f" * 64}
    assert "its layer is" in await templates._damage(template)
    del diskd.disks[template.name]
    assert await templates._damage(template) == "its layer is missing"
    memory.unlink()
    assert await templates._damage(template) == "its snapshot is missing"


async def test_a_removed_template_leaves_nothing_of_its_own(tmp_path: Path) -> None:
    diskd = _Diskd()
    templates, template = _kept(tmp_path, diskd)
    await templates.remove(template.name)
    assert templates.list() == [] and diskd.disks == {}
    assert not (tmp_path / "templates" / template.name).exists()
    with pytest.raises(FeosError) as e:
        await templates.remove(template.name)
    assert e.value.code is Code.NOT_FOUND


async def test_two_makes_of_one_key_make_it_once(tmp_path: Path) -> None:
    templates = Templates(tmp_path, _Vms(), _Diskd(), vmm_version=lambda: "7.2.15")  # type: ignore[arg-type]
    made: list[str] = []
    release = trio.Event()

    async def make(key: TemplateKey) -> Template:
        made.append(key.name)
        await release.wait()
        template = Template(key, "sha256:" + "e" * 64, "sha256:" + "d" * 64, 1, 1)
        templates._have[key.name] = template
        return template

    templates._make = make  # type: ignore[method-assign]
    results: list[Template] = []

    async def one() -> None:
        results.append(await templates.make(_key()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert len(made) == 1
        release.set()
    assert made == [_key().name] and results[0] == results[1]
