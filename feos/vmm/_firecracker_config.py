"""config.json: a microVM's Firecracker configuration, and the API calls that apply it.

The file is written once at creation (node.md, "A pod's microVM") in Firecracker's own config-file
format, so that it reads as Firecracker's documentation says. A start does not hand it to
--config-file, which would boot at once: it puts each section through the API and then sends
InstanceStart, so that every step answers on its own and a failure names its section. Paths are
the jail's: Firecracker runs chrooted into root/.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from feos.errors import invalid

# The guest's drives by order (guest contract): vda root, vdb data, vdc vol1, ...
ROOT_DRIVE = "root"
DATA_DRIVE = "data"
GUEST_CID = 3
IFACE = "eth0"
_MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
# Firecracker's balloon learned free page reporting after 1.12 (v1.12.1 refuses the field).
FREE_PAGE_REPORTING_SINCE = (1, 14)


@attrs.frozen
class FcConfig:
    """What config.json is made from, with the names the files have inside the jail."""

    vcpus: int
    memory_mib: int
    kernel: str = "vmlinux"
    initrd: str | None = "initramfs"
    root_image: str = "root.erofs"
    data: str | None = None
    volumes: tuple[str, ...] = ()
    tap: str | None = None
    mac: str | None = None
    tsc_khz: int | None = None
    kernel_extra: tuple[str, ...] = ()
    version: tuple[int, int, int] = (1, 12, 1)


def parse_version(text: str) -> tuple[int, int, int]:
    """"v1.12.1" or "Firecracker v1.12.1" -> (1, 12, 1)."""
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"not a Firecracker version: {text!r}")
    return int(m[1]), int(m[2]), int(m[3])


def boot_args(cfg: FcConfig) -> str:
    """The guest contract's kernel command line, the guest link on vsock."""
    words = ["console=ttyS0", "reboot=t", "panic=-1"]
    if cfg.tsc_khz:
        words.append(f"tsc_early_khz={cfg.tsc_khz}")
    words.append("feos.link=vsock")
    return " ".join([*words, *cfg.kernel_extra])


def _drive(drive_id: str, path: str, *, read_only: bool) -> dict[str, Any]:
    # Writeback: the guest's flushes reach the disk's server (diskd) rather than stay in
    # Firecracker's own cache only.
    return {"drive_id": drive_id, "path_on_host": path, "is_root_device": False,
            "is_read_only": read_only, "cache_type": "Writeback", "io_engine": "Sync"}


def validate(cfg: FcConfig) -> None:
    if not 1 <= cfg.vcpus <= 32:
        raise invalid("spec.vcpus", "must be 1 to 32")
    if cfg.memory_mib < 128:
        raise invalid("spec.memory_mib", "must be at least 128")
    if (cfg.tap is None) != (cfg.mac is None):
        raise invalid("spec.mac", "a network device needs both a TAP and a MAC")
    if cfg.mac is not None and not _MAC_RE.match(cfg.mac):
        raise invalid("spec.mac", "must be six lowercase hex pairs")
    if cfg.volumes and cfg.data is None:
        raise invalid("spec.volumes", "volumes come after a data disk")


def build(cfg: FcConfig) -> dict[str, Any]:
    """The config.json object."""
    validate(cfg)
    boot: dict[str, Any] = {"kernel_image_path": cfg.kernel, "boot_args": boot_args(cfg)}
    if cfg.initrd:
        boot["initrd_path"] = cfg.initrd
    drives = [_drive(ROOT_DRIVE, cfg.root_image, read_only=True)]
    if cfg.data is not None:
        drives.append(_drive(DATA_DRIVE, cfg.data, read_only=False))
    drives += [_drive(f"vol{i}", v, read_only=False) for i, v in enumerate(cfg.volumes, 1)]
    balloon: dict[str, Any] = {"amount_mib": 0, "deflate_on_oom": True,
                               "stats_polling_interval_s": 1}
    if cfg.version[:2] >= FREE_PAGE_REPORTING_SINCE:
        balloon["free_page_reporting"] = True
    out: dict[str, Any] = {
        "boot-source": boot,
        "drives": drives,
        "machine-config": {"vcpu_count": cfg.vcpus, "mem_size_mib": cfg.memory_mib,
                           "smt": False, "track_dirty_pages": False},
        "vsock": {"guest_cid": GUEST_CID, "uds_path": "v.sock"},
        "balloon": balloon,
        "entropy": {},
        "network-interfaces": [],
    }
    if cfg.tap is not None:
        out["network-interfaces"] = [{"iface_id": IFACE, "host_dev_name": cfg.tap,
                                      "guest_mac": cfg.mac}]
        out["mmds-config"] = {"version": "V2", "network_interfaces": [IFACE]}
    return out


def encode(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def api_calls(config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The config as (method, path, body) calls before InstanceStart, in an order Firecracker
    accepts: MMDS names its interface, so it comes after the interfaces."""
    calls: list[tuple[str, str, Any]] = [
        ("PUT", "/machine-config", config["machine-config"]),
        ("PUT", "/boot-source", config["boot-source"]),
    ]
    calls += [("PUT", f"/drives/{d['drive_id']}", d) for d in config["drives"]]
    calls += [("PUT", f"/network-interfaces/{n['iface_id']}", n)
              for n in config.get("network-interfaces", [])]
    for key, path in (("vsock", "/vsock"), ("balloon", "/balloon"), ("entropy", "/entropy"),
                      ("mmds-config", "/mmds/config")):
        if key in config:
            calls.append(("PUT", path, config[key]))
    return calls
