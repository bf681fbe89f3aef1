"""config.json as the guest contract and the spec want it, and the API calls that apply it."""

from __future__ import annotations

import json

import pytest

from feos.errors import FeosError
from feos.vmm import _firecracker_config as fcc
from feos.vmm._firecracker_config import FcConfig

FULL = FcConfig(vcpus=2, memory_mib=1024, data="data", volumes=("volume1", "volume2"),
                tap="pod-abc", mac="06:00:01:02:03:04", tsc_khz=2596144)


def test_kernel_command_line_of_the_contract() -> None:
    assert fcc.boot_args(FULL) == (
        "console=ttyS0 reboot=t panic=-1 tsc_early_khz=2596144 feos.link=vsock")
    floor = FcConfig(vcpus=1, memory_mib=512, kernel_extra=("feos.floor=shell",))
    assert fcc.boot_args(floor) == (
        "console=ttyS0 reboot=t panic=-1 feos.link=vsock feos.floor=shell")


def test_drives_in_the_contract_order_with_writeback() -> None:
    drives = fcc.build(FULL)["drives"]
    assert [(d["drive_id"], d["path_on_host"], d["is_read_only"]) for d in drives] == [
        ("root", "root.erofs", True), ("data", "data", False),
        ("vol1", "volume1", False), ("vol2", "volume2", False)]
    assert {d["cache_type"] for d in drives} == {"Writeback"}
    assert not any(d["is_root_device"] for d in drives)


def test_network_vsock_balloon_mmds() -> None:
    cfg = fcc.build(FULL)
    assert cfg["network-interfaces"] == [
        {"iface_id": "eth0", "host_dev_name": "pod-abc", "guest_mac": "06:00:01:02:03:04"}]
    assert cfg["vsock"] == {"guest_cid": 3, "uds_path": "v.sock"}
    assert cfg["mmds-config"] == {"version": "V2", "network_interfaces": ["eth0"]}
    assert cfg["machine-config"]["vcpu_count"] == 2
    assert cfg["machine-config"]["mem_size_mib"] == 1024
    assert cfg["balloon"]["deflate_on_oom"] is True
    assert cfg["balloon"]["stats_polling_interval_s"] > 0


def test_free_page_reporting_only_where_firecracker_has_it() -> None:
    assert "free_page_reporting" not in fcc.build(FULL)["balloon"]
    newer = fcc.build(FcConfig(vcpus=1, memory_mib=512, version=(1, 17, 0)))
    assert newer["balloon"]["free_page_reporting"] is True


def test_no_network_no_mmds() -> None:
    cfg = fcc.build(FcConfig(vcpus=1, memory_mib=512))
    assert cfg["network-interfaces"] == []
    assert "mmds-config" not in cfg


def test_api_calls_put_mmds_after_its_interface() -> None:
    paths = [p for _, p, _ in fcc.api_calls(fcc.build(FULL))]
    assert paths[:2] == ["/machine-config", "/boot-source"]
    assert paths.index("/mmds/config") > paths.index("/network-interfaces/eth0")
    assert "/drives/vol2" in paths


def test_encoded_is_json() -> None:
    assert json.loads(fcc.encode(fcc.build(FULL))) == fcc.build(FULL)


@pytest.mark.parametrize(("cfg", "field"), [
    (FcConfig(vcpus=0, memory_mib=512), "spec.vcpus"),
    (FcConfig(vcpus=33, memory_mib=512), "spec.vcpus"),
    (FcConfig(vcpus=1, memory_mib=64), "spec.memory_mib"),
    (FcConfig(vcpus=1, memory_mib=512, tap="pod-x"), "spec.mac"),
    (FcConfig(vcpus=1, memory_mib=512, tap="pod-x", mac="06:00:01:02:03"), "spec.mac"),
    (FcConfig(vcpus=1, memory_mib=512, volumes=("v",)), "spec.volumes"),
])
def test_invalid_specs(cfg: FcConfig, field: str) -> None:
    with pytest.raises(FeosError, match=field):
        fcc.build(cfg)


def test_parse_version() -> None:
    assert fcc.parse_version("Firecracker v1.12.1\n") == (1, 12, 1)
    assert fcc.parse_version("v1.17.0") == (1, 17, 0)
    with pytest.raises(ValueError, match="not a Firecracker version"):
        fcc.parse_version("nightly")
