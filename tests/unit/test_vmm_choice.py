"""The node's VMM (feosd --vmm): the decision from the probes' answers, the Firecracker probe's
steps with fakes of what it runs, its cache, and feosd's refusal of a Firecracker it cannot run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from feos.errors import Code, FeosError
from feos.vmm import _choice
from feos.vmm._choice import FcProbe, VmmChoice, choose_vmm, decide, probe_firecracker
from feos.vmm._kvm import KvmProbe

KVM = KvmProbe(True, "vmlinux reached init under KVM")
NO_KVM = KvmProbe(False, "KVM here is PVM (kvm_pvm): stock guest kernels cannot finish booting")
FC = FcProbe(True, "Firecracker v1.12.1 boots guest g1 under KVM")
NO_FC = FcProbe(False, "no Firecracker installed in /x nor in PATH")


# -- decide: each branch and its reason ----------------------------------------------------------


def test_auto_takes_firecracker_where_it_boots_the_guest() -> None:
    assert decide("auto", KVM, FC) == VmmChoice("firecracker", "kvm", FC.reason, "auto")


def test_auto_falls_back_to_qemu_under_kvm() -> None:
    got = decide("auto", KVM, NO_FC)
    assert (got.driver, got.accel) == ("qemu", "kvm")
    assert got.reason == f"Firecracker cannot run: {NO_FC.reason}; KVM runs guests: {KVM.reason}"


def test_auto_falls_back_to_qemu_on_tcg() -> None:
    fc = FcProbe(False, f"KVM cannot run a guest: {NO_KVM.reason}")
    got = decide("auto", NO_KVM, fc)
    assert (got.driver, got.accel) == ("qemu", "tcg")
    assert got.reason == f"Firecracker cannot run: {fc.reason}; no KVM: {NO_KVM.reason}"
    assert got.describe() == "QEMU under TCG"


def test_qemu_is_forced_even_where_firecracker_runs() -> None:
    assert decide("qemu", KVM, None) == VmmChoice(
        "qemu", "kvm", f"--vmm qemu; KVM runs guests: {KVM.reason}", "qemu")
    assert decide("qemu", NO_KVM, None).accel == "tcg"


def test_explicit_firecracker_runs_or_refuses_in_one_line() -> None:
    assert decide("firecracker", KVM, FC).describe() == "Firecracker under KVM"
    with pytest.raises(FeosError) as e:
        decide("firecracker", KVM, NO_FC)
    assert e.value.code is Code.FAILED_PRECONDITION
    assert e.value.message == f"--vmm firecracker: Firecracker cannot run here: {NO_FC.reason}"
    assert "\n" not in e.value.message


def test_an_unknown_request_is_refused() -> None:
    with pytest.raises(FeosError, match="--vmm: 'kvmtool' is none of auto, firecracker, qemu"):
        decide("kvmtool", KVM, FC)


# -- choose_vmm: which probes run ----------------------------------------------------------------


async def test_qemu_does_not_probe_firecracker(tmp_path: Path) -> None:
    def firecracker(kvm: KvmProbe, state: Path) -> FcProbe:
        raise AssertionError("probed")

    got = await choose_vmm("qemu", tmp_path, kvm=lambda: NO_KVM, firecracker=firecracker)
    assert (got.driver, got.accel, got.requested) == ("qemu", "tcg", "qemu")


async def test_auto_hands_the_kvm_answer_to_the_firecracker_probe(tmp_path: Path) -> None:
    seen: list[tuple[KvmProbe, Path]] = []

    def firecracker(kvm: KvmProbe, state: Path) -> FcProbe:
        seen.append((kvm, state))
        return FC

    got = await choose_vmm("auto", tmp_path, kvm=lambda: KVM, firecracker=firecracker)
    assert seen == [(KVM, tmp_path)]
    assert got.driver == "firecracker"


async def test_explicit_firecracker_on_this_kind_of_host_refuses(tmp_path: Path) -> None:
    with pytest.raises(FeosError, match=r"--vmm firecracker: Firecracker cannot run here: KVM "
                       r"cannot run a guest: KVM here is PVM"):
        await choose_vmm("firecracker", tmp_path, kvm=lambda: NO_KVM)


# -- the Firecracker probe's steps -------------------------------------------------------------


def _install(root: Path, jailer_code: int = 0) -> Path:
    d = root / "fc" / "v1.12.1"
    d.mkdir(parents=True)
    (d / "firecracker").write_text("#!/bin/sh\nexit 0\n")
    (d / "jailer").write_text(f"#!/bin/sh\necho jailer v1.12.1\nexit {jailer_code}\n")
    for name in ("firecracker", "jailer"):
        os.chmod(d / name, 0o755)
    return root / "fc"


def _guest(root: Path, version: str = "g1") -> Path:
    g = root / "guest" / version
    g.mkdir(parents=True)
    (g / "manifest.json").write_text(json.dumps({"version": version, "built": version}))
    (g / "vmlinux").write_bytes(b"\x7fELF")
    (g / "initramfs").write_bytes(b"")
    return root / "guest"


class Booter:
    def __init__(self, answer: str | None = None) -> None:
        self.answer = answer
        self.boots: list[tuple[Path, Path, Path | None]] = []

    def __call__(self, firecracker: Path, kernel: Path, initrd: Path | None) -> str | None:
        self.boots.append((firecracker, kernel, initrd))
        return self.answer


def test_no_kvm_means_no_boot(tmp_path: Path) -> None:
    booter = Booter()
    got = probe_firecracker(NO_KVM, tmp_path, booter=booter)
    assert got == FcProbe(False, f"KVM cannot run a guest: {NO_KVM.reason}")
    assert booter.boots == []


def test_no_firecracker_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEOS_FIRECRACKER_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    got = probe_firecracker(KVM, tmp_path, booter=Booter())
    assert not got.usable
    assert got.reason == f"no Firecracker installed in {tmp_path / 'none'} nor in PATH"


def test_a_jailer_that_does_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEOS_FIRECRACKER_DIR", str(_install(tmp_path, jailer_code=3)))
    got = probe_firecracker(KVM, tmp_path, guest_dir=_guest(tmp_path), booter=Booter())
    assert not got.usable
    assert got.reason.endswith("jailer does not run: exit 3")


def test_no_guest_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEOS_FIRECRACKER_DIR", str(_install(tmp_path)))
    got = probe_firecracker(KVM, tmp_path, guest_dir=tmp_path / "empty", booter=Booter())
    assert got == FcProbe(False, f"no guest is installed in {tmp_path / 'empty'}")


def test_the_boot_decides_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fc_root = _install(tmp_path)
    monkeypatch.setenv("FEOS_FIRECRACKER_DIR", str(fc_root))
    guests = _guest(tmp_path)
    state = tmp_path / "state"
    booter = Booter()
    got = probe_firecracker(KVM, state, guest_dir=guests, booter=booter)
    assert got == FcProbe(True, "Firecracker v1.12.1 boots guest g1 under KVM")
    assert booter.boots == [(fc_root / "v1.12.1" / "firecracker", guests / "g1" / "vmlinux",
                             guests / "g1" / "initramfs")]
    again = Booter("never asked")
    assert probe_firecracker(KVM, state, guest_dir=guests, booter=again) == got
    assert again.boots == []  # the second start reads the cache
    assert json.loads((state / "vmm-probe.json").read_text())["key"]["guest"] == "g1"


def test_the_cache_is_keyed_by_guest_and_binaries(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fc_root = _install(tmp_path)
    monkeypatch.setenv("FEOS_FIRECRACKER_DIR", str(fc_root))
    guests = _guest(tmp_path)
    state = tmp_path / "state"
    probe_firecracker(KVM, state, guest_dir=guests, booter=Booter())
    _guest(tmp_path, "g2")  # a newer guest: probed again
    failing = Booter("the guest's kernel cannot boot under Firecracker (exit 1): oops")
    got = probe_firecracker(KVM, state, guest_dir=guests, booter=failing)
    assert got == FcProbe(False, failing.answer or "")
    assert len(failing.boots) == 1
    binary = fc_root / "v1.12.1" / "firecracker"
    binary.write_text("#!/bin/sh\n# another build\nexit 0\n")  # another binary: probed again
    ok = Booter()
    assert probe_firecracker(KVM, state, guest_dir=guests, booter=ok).usable
    assert len(ok.boots) == 1


def test_a_cache_of_another_shape_is_probed_again(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    key = {"guest": "g1"}
    for text in ("", "[]", '{"key": {"guest": "g1"}, "usable": 1, "reason": "x"}'):
        path.write_text(text)
        assert _choice.read_cache(path, key) is None
    _choice.write_cache(path, key, FC)
    assert _choice.read_cache(path, key) == FC
    assert _choice.read_cache(path, {"guest": "g2"}) is None


def test_judge_boot() -> None:
    assert _choice.judge_boot("[ 0.8] Run /init as init process\n", None) is None
    internal = "[ERROR] Vcpu error: KVM_EXIT_INTERNAL_ERROR\nexit\n"
    assert _choice.judge_boot(internal, 1) == (
        "the guest's kernel cannot boot under Firecracker (exit 1): [ERROR] Vcpu error: "
        "KVM_EXIT_INTERNAL_ERROR")
    assert _choice.judge_boot("", None) == (
        "the guest's kernel did not reach init under Firecracker within 20s (no output)")


def test_boot_config_has_no_disk_and_the_initramfs() -> None:
    config = _choice.boot_config(Path("/g/vmlinux"), Path("/g/initramfs"))
    assert config["drives"] == []
    assert config["boot-source"]["initrd_path"] == "/g/initramfs"
    assert "initrd_path" not in _choice.boot_config(Path("/g/vmlinux"), None)["boot-source"]
