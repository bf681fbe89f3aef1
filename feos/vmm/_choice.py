"""Which VMM runs this node's pods (`feosd --vmm auto|firecracker|qemu`), and why.

Theory of operation. feosd decides once, at its start, before any pod boots:

- auto: Firecracker (in its jailer, the guest link over vsock, metadata from MMDS) where the
  Firecracker probe shows it boots the installed guest under KVM; else QEMU under KVM where the
  KVM probe shows a guest kernel boots (_kvm.py); else QEMU on TCG.
- firecracker: Firecracker, or feosd does not start: the reason in one line.
- qemu: QEMU, under KVM where the KVM probe says it works, else TCG. Firecracker is not probed.

`decide` is pure: the two probes' answers in, a `VmmChoice` out (the VMM, its accelerator and
the reason, for the log and `feosctl host info`). The probes:

- KVM: `_kvm.kvm_probe`, cached per boot of the host in /run.
- Firecracker, in steps that can each say no: KVM runs a guest kernel (the KVM probe's answer:
  Firecracker has no TCG, so where QEMU's KVM boot fails, Firecracker is not tried); a
  Firecracker and its jailer are installed and the jailer answers `--version`; a guest is
  installed; and Firecracker (`--no-api --config-file`) boots that guest's kernel and
  initramfs to the point where it runs init within BOOT_TIMEOUT_S. The answer is kept in
  <state>/vmm-probe.json, keyed by the guest's version, both binaries' identity (path, size,
  mtime) and the host's kernel release; a change of any of them probes again.

A pod keeps the VMM it booted with (vms.db's `driver`): this choice applies to what boots anew.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import select
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

from . import _jail
from ._kvm import KvmProbe

log = logging.getLogger("feos.vmm")

REQUESTS = ("auto", "firecracker", "qemu")
BOOT_TIMEOUT_S = 20.0
CACHE_NAME = "vmm-probe.json"
BOOT_MARKERS = ("Run /init as init process", "Freeing unused kernel", "VFS: Unable to mount root")
NAMES = {"qemu": "QEMU", "firecracker": "Firecracker"}  # how people read a driver's name


def vmm_name(driver: str) -> str:
    """A driver's name as the messages say it: "QEMU", "Firecracker"."""
    return NAMES.get(driver, driver)


@attrs.frozen
class VmmChoice:
    """What boots this node's pods, and why (the log, HostInfo.vmm)."""

    driver: str  # "firecracker" or "qemu"
    accel: str  # "kvm" or "tcg"
    reason: str
    requested: str = "auto"

    def describe(self) -> str:
        return f"{vmm_name(self.driver)} under {self.accel.upper()}"


@attrs.frozen
class FcProbe:
    """Whether Firecracker boots the installed guest here, and why (or why not)."""

    usable: bool
    reason: str


# -- the decision, pure ------------------------------------------------------------------------


def decide(requested: str, kvm: KvmProbe, firecracker: FcProbe | None) -> VmmChoice:
    """The VMM of the node from --vmm and the probes' answers (firecracker None: not probed).

    --vmm firecracker that cannot run raises FAILED_PRECONDITION, one line naming why."""
    if requested not in REQUESTS:
        raise FeosError(Code.INVALID_ARGUMENT, f"--vmm: {requested!r} is none of "
                        f"{', '.join(REQUESTS)}")
    fc_ok = firecracker is not None and firecracker.usable
    if requested == "firecracker":
        if not fc_ok:
            why = firecracker.reason if firecracker is not None else "not probed"
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"--vmm firecracker: Firecracker cannot run here: {why}")
        assert firecracker is not None
        return VmmChoice("firecracker", "kvm", firecracker.reason, requested)
    if requested == "auto" and fc_ok:
        assert firecracker is not None
        return VmmChoice("firecracker", "kvm", firecracker.reason, requested)
    accel = "kvm" if kvm.usable else "tcg"
    qemu = f"KVM runs guests: {kvm.reason}" if kvm.usable else f"no KVM: {kvm.reason}"
    if requested == "qemu":
        return VmmChoice("qemu", accel, f"--vmm qemu; {qemu}", requested)
    why_not = firecracker.reason if firecracker is not None else "not probed"
    return VmmChoice("qemu", accel, f"Firecracker cannot run: {why_not}; {qemu}", requested)


# -- the Firecracker probe ---------------------------------------------------------------------


def judge_boot(output: str, code: int | None) -> str | None:
    """None when the console shows the kernel running init, else why not (one line)."""
    if any(m in output for m in BOOT_MARKERS):
        return None
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    last = (errors or lines or ["no output"])[-1][:200]
    if code is None:
        return f"the guest's kernel did not reach init under Firecracker within " \
               f"{BOOT_TIMEOUT_S:g}s ({last})"
    return f"the guest's kernel cannot boot under Firecracker (exit {code}): {last}"


def boot_config(kernel: Path, initrd: Path | None) -> dict[str, Any]:
    """Firecracker's config file for the probe's boot: no disk, no network, 128 MiB."""
    boot: dict[str, Any] = {"kernel_image_path": str(kernel),
                            "boot_args": "console=ttyS0 reboot=k panic=-1 pci=off"}
    if initrd is not None:
        boot["initrd_path"] = str(initrd)
    return {"boot-source": boot, "drives": [],
            "machine-config": {"vcpu_count": 1, "mem_size_mib": 128}}


def boot_firecracker(firecracker: Path, kernel: Path, initrd: Path | None, *,
                     timeout: float = BOOT_TIMEOUT_S,
                     markers: tuple[str, ...] = BOOT_MARKERS) -> str | None:
    """Boot `kernel` under `firecracker` until the console shows a marker (None), or why not."""
    with tempfile.TemporaryDirectory(prefix="feos-fc-probe-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(boot_config(kernel, initrd)))
        argv = [str(firecracker), "--no-api", "--config-file", str(config), "--level", "Error"]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=tmp)
        try:
            output, code = _read_until(proc, markers, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    if any(m in output for m in markers):
        return None
    return judge_boot(output, code)


def _read_until(proc: subprocess.Popen[bytes], markers: tuple[str, ...],
                timeout: float) -> tuple[str, int | None]:
    """The console until a marker shows, the process ends or the time is up (code None)."""
    assert proc.stdout is not None
    fd, seen, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        chunk = os.read(fd, 65536) if ready else b""
        seen += chunk
        text = seen.decode(errors="replace")
        if any(m in text for m in markers):
            return text, None
        if ready and not chunk:  # EOF: it ended
            return text, proc.wait()
    return seen.decode(errors="replace"), None


def _identity(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _jailer_answers(jailer: Path) -> str | None:
    try:
        done = subprocess.run([str(jailer), "--version"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the jailer {jailer} does not run: {exc}"
    if done.returncode != 0:
        return f"the jailer {jailer} does not run: exit {done.returncode}"
    return None


Booter = Callable[[Path, Path, "Path | None"], "str | None"]


def probe_firecracker(kvm: KvmProbe, state_dir: Path, *, guest_dir: Path | None = None,
                      booter: Booter | None = None) -> FcProbe:
    """Whether Firecracker boots the installed guest here (blocking: up to BOOT_TIMEOUT_S on a
    cache miss). The steps of the module's comment; the boot's answer is cached."""
    if not kvm.usable:
        return FcProbe(False, f"KVM cannot run a guest: {kvm.reason}")
    try:
        install = _jail.choose()
    except FeosError as exc:
        return FcProbe(False, exc.message)
    failed = _jailer_answers(install.jailer)
    if failed is not None:
        return FcProbe(False, failed)
    try:
        from ._service import guest_root, newest_guest

        version, gdir = newest_guest(guest_dir or guest_root())
    except FeosError as exc:
        return FcProbe(False, exc.message)
    initrd = gdir / "initramfs" if (gdir / "initramfs").exists() else None
    key = {"guest": version, "firecracker": _identity(install.firecracker),
           "jailer": _identity(install.jailer), "kernel": platform.release()}
    cache = state_dir / CACHE_NAME
    cached = read_cache(cache, key)
    if cached is not None:
        return cached
    failed = (booter or boot_firecracker)(install.firecracker, gdir / "vmlinux", initrd)
    answer = FcProbe(True, f"Firecracker {install.version} boots guest {version} under KVM") \
        if failed is None else FcProbe(False, failed)
    write_cache(cache, key, answer)
    return answer


def read_cache(path: Path, key: dict[str, Any]) -> FcProbe | None:
    """The cached answer if it was probed with the same key, else None (probed again)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("key") != key:
        return None
    usable, reason = raw.get("usable"), raw.get("reason")
    if not isinstance(usable, bool) or not isinstance(reason, str):
        return None
    return FcProbe(usable, reason)


def write_cache(path: Path, key: dict[str, Any], answer: FcProbe) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, **attrs.asdict(answer)}, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # not kept: probed again at the next start, which is only slower


# -- at feosd's start --------------------------------------------------------------------------


def _kvm_answer() -> KvmProbe:
    from ._kvm import kvm_probe

    try:
        return kvm_probe()
    except OSError as exc:
        return KvmProbe(False, f"KVM could not be probed: {exc}")


async def choose_vmm(requested: str, state_dir: Path, *,
                     kvm: Callable[[], KvmProbe] = _kvm_answer,
                     firecracker: Callable[[KvmProbe, Path], FcProbe] = probe_firecracker,
                     ) -> VmmChoice:
    """The node's VMM (the probes on a worker thread); FAILED_PRECONDITION for an explicit
    --vmm firecracker that cannot run."""
    if requested not in REQUESTS:
        decide(requested, KvmProbe(False, ""), None)  # raises INVALID_ARGUMENT
    kvm_answer = await trio.to_thread.run_sync(kvm)
    fc_answer = None
    if requested != "qemu":
        fc_answer = await trio.to_thread.run_sync(firecracker, kvm_answer, state_dir)
    choice = decide(requested, kvm_answer, fc_answer)
    log.info("the pods' VMM: %s (--vmm %s): %s", choice.describe(), requested, choice.reason)
    return choice
