"""What `feosctl host info` says of the node's VMM: HostInfo.vmm, its table rows, --vmm."""

from __future__ import annotations

import pytest

from feos._host import vmm_info
from feos.cli._commands import _vmm_rows
from feos.daemon import parse_args
from feos.vmm._choice import VmmChoice

CHOICE = VmmChoice("qemu", "tcg", "Firecracker cannot run: KVM cannot run a guest: PVM; no KVM: "
                   "PVM", "auto")


def test_host_info_names_the_vmm_the_accelerator_and_why() -> None:
    got = vmm_info(CHOICE, ["qemu", "firecracker", "qemu"])
    assert got == {"driver": "qemu", "accel": "tcg", "reason": CHOICE.reason,
                   "requested": "auto", "microvms": [{"driver": "firecracker", "count": 1},
                                                      {"driver": "qemu", "count": 2}]}
    assert vmm_info(None, []) == {"reason": "not decided yet", "microvms": []}


def test_the_table_says_it_for_people() -> None:
    rows = dict(_vmm_rows(vmm_info(CHOICE, ["qemu", "firecracker", "qemu"])))
    assert rows["vmm"] == "QEMU under TCG"
    assert rows["vmm reason"] == CHOICE.reason
    assert rows["vmm asked"] == "--vmm auto"
    assert rows["microvms"] == "Firecracker 1, QEMU 2"
    assert dict(_vmm_rows({}))["vmm"] == "-"


def test_the_vmm_option() -> None:
    assert parse_args([]).vmm == "auto"
    assert parse_args(["--vmm", "firecracker"]).vmm == "firecracker"
    with pytest.raises(SystemExit):
        parse_args(["--vmm", "kvmtool"])
