"""The stores' calls structured at the API's edge: typed values in, INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from feos.errors import Code, FeosError
from feos.net._stores import NameTableService, SecurityGroupService


def _nobody(_id: str) -> list[str]:
    return []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"group": {"id": "web", "rulesIn": [{"protocol": "sctp", "peer": {"group": "web"}}]}},
         r"rules_in\[0\]\.protocol: must be one of"),
        ({"group": {"id": "web", "rulesOut": [{"protocol": "tcp"}]}},
         r"rules_out\[0\]\.peer: must be an address block or a group$"),
        ({}, "group: required field missing"),
        ({"id": 7}, "group: required field missing"),
    ],
)
async def test_a_bad_security_group_names_its_field(
    tmp_path: Path, params: dict[str, object], message: str
) -> None:
    service = SecurityGroupService(tmp_path, _nobody)
    try:
        with pytest.raises(FeosError, match=f"^INVALID_ARGUMENT: {message}") as caught:
            await service.put_security_group(params)
        assert caught.value.code is Code.INVALID_ARGUMENT
        assert len(service.store) == 0
    finally:
        service.close()


async def test_name_table_calls_take_typed_params(tmp_path: Path) -> None:
    service = NameTableService(tmp_path, _nobody)
    try:
        await service.put_name_table({"table": {"id": "t1", "version": 1, "names": [
            {"name": "db", "addresses": ["10.0.0.1"]}]}})
        answer = await service.update_name_table(
            {"id": "t1", "fromVersion": 1, "toVersion": 2,
             "put": [{"name": "web", "addresses": ["10.0.0.2"]}], "remove": ["db"]})
        assert [n["name"] for n in answer["table"]["names"]] == ["web"]
        for params, message in [
            ({"id": "t1", "fromVersion": "2", "toVersion": 3}, "fromVersion: invalid value"),
            ({"id": "T 1"}, "id: must be one DNS label"),
            ({"id": "t1", "fromVersion": 2, "toVersion": 3,
              "put": [{"name": "a"}, {"name": "a"}]}, r"put\[1\]\.name: a is given twice"),
        ]:
            with pytest.raises(FeosError, match=f"^INVALID_ARGUMENT: {message}"):
                await service.update_name_table(params)
        with pytest.raises(FeosError, match=r"^INVALID_ARGUMENT: names\[0\]\.addresses"):
            await service.put_name_table({"table": {"id": "t2", "names": [
                {"name": "x", "addresses": [5]}]}})
        assert service.store.get("t1").version == 2  # type: ignore[union-attr]
    finally:
        service.close()


async def test_host_and_traffic_calls_take_typed_params(tmp_path: Path) -> None:
    from feos._host import HostService
    from feos.net._traffic import RecordHub
    from feos.net._traffic_service import TrafficService

    host = HostService(state_dir=tmp_path, self_upgrade=True, binary=tmp_path / "feosd",
                       upgrade=lambda _path: None, versions=dict)
    with pytest.raises(FeosError, match="^INVALID_ARGUMENT: binary: invalid value for type"):
        await host.upgrade_feos_binary({"binary": "not bytes", "sha256": "0" * 64})
    with pytest.raises(FeosError, match="^INVALID_ARGUMENT: sha256: must be 64 hex digits"):
        await host.upgrade_feos_binary({"binary": b"x", "sha256": "abc"})
    traffic = TrafficService(RecordHub())
    with pytest.raises(FeosError, match="^INVALID_ARGUMENT: podId: invalid value for type"):
        await traffic.watch_traffic({"podId": 5})
