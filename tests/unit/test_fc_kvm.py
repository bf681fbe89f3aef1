"""The KVM probe's pure parts: its cache, its judgement of a boot, the known failure modes."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from feos.vmm import _kvm
from feos.vmm._kvm import KvmProbe


def test_cache_round_trip_within_a_boot() -> None:
    answer = KvmProbe(usable=False, reason="PVM", boot_id="b1")
    assert _kvm.parse_cache(_kvm.format_cache(answer), "b1") == answer


def test_cache_of_another_boot_is_asked_again() -> None:
    text = _kvm.format_cache(KvmProbe(usable=True, reason="ok", boot_id="b1"))
    assert _kvm.parse_cache(text, "b2") is None


@given(st.text())
def test_cache_parser_takes_any_text(text: str) -> None:
    got = _kvm.parse_cache(text, "b")
    assert got is None or (isinstance(got.usable, bool) and got.boot_id == "b")


def test_cache_with_wrong_types_is_ignored() -> None:
    assert _kvm.parse_cache('{"boot_id": "b", "usable": 1, "reason": "x"}', "b") is None
    assert _kvm.parse_cache('["b"]', "b") is None


def test_judge_boot() -> None:
    booted = "[    0.9] Run /init as init process\n"
    assert _kvm.judge_boot(booted, 0) is None
    msr = "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\nAssertion failed\n"
    assert _kvm.judge_boot(msr, -6) == (
        "a guest kernel cannot boot under KVM: qemu-system-x86_64: error: failed to set MSR 0x10a"
        " to 0x69")
    assert _kvm.judge_boot("one\ntwo\n", 1) == "a guest kernel cannot boot under KVM: two"
    assert "within 20s" in (_kvm.judge_boot("", None) or "")


def test_known_failures(tmp_path: Path) -> None:
    modules = tmp_path / "module"
    modules.mkdir()
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor: 0\nflags\t\t: fpu vme sse2 vmx\n")
    assert _kvm.known_failure(modules, cpuinfo) is None
    cpuinfo.write_text("flags\t\t: fpu vme sse2\n")
    assert "no vmx or svm" in (_kvm.known_failure(modules, cpuinfo) or "")
    (modules / "kvm_pvm").mkdir()
    assert "PVM" in (_kvm.known_failure(modules, cpuinfo) or "")


def test_boot_argv_asks_for_kvm() -> None:
    argv = _kvm.boot_argv("qemu", Path("/k/vmlinux"))
    assert argv[argv.index("-accel") + 1] == "kvm"
    assert argv[argv.index("-kernel") + 1] == "/k/vmlinux"
