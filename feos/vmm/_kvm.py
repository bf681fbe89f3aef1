"""Whether /dev/kvm can really run a guest: the probe, and its answer cached per boot of the host.

A /dev/kvm that opens is not enough: on hosts whose KVM is PVM (kvm_pvm, a software hypervisor),
a tiny real-mode guest runs, yet a stock kernel cannot finish booting (QEMU dies on MSR 0x10a or
an emulation failure, Firecracker's guest with KVM_EXIT_INTERNAL_ERROR; environment.md). So the
probe goes in steps, each of which can say no:

1. /dev/kvm opens and speaks KVM API 12;
2. a tiny guest runs: three real-mode instructions that write a byte to a port and halt;
3. where an installed guest kernel and QEMU are there, that kernel boots under KVM and reaches
   the point where it starts init within BOOT_TIMEOUT_S (the decisive test);
4. without them, the known failure modes: KVM backed by kvm_pvm, or a CPU without vmx/svm.

The answer holds until the host reboots: it is kept in /run/feos-kvm-probe with the boot's
/proc/sys/kernel/random/boot_id, and asked again only after a reboot. The node's VMM choice
(_choice.py) asks it whether QEMU runs under KVM or TCG, and whether Firecracker is worth trying
at all; Firecracker's tests whether a guest can boot.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import trio

CACHE = Path("/run/feos-kvm-probe")
BOOT_TIMEOUT_S = 20.0
TINY_TIMEOUT_S = 5.0
_BOOT_MARKERS = ("Run /init as init process", "Freeing unused kernel", "VFS: Unable to mount root")


@attrs.frozen
class KvmProbe:
    """The probe's answer: can KVM run a guest here, and why (for the log and host info)."""

    usable: bool
    reason: str
    boot_id: str = ""


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def parse_cache(text: str, current_boot: str) -> KvmProbe | None:
    """The cached answer if it is of this boot, else None (asked again)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    if not isinstance(raw, dict) or raw.get("boot_id") != current_boot:
        return None
    usable, reason = raw.get("usable"), raw.get("reason")
    if not isinstance(usable, bool) or not isinstance(reason, str):
        return None
    return KvmProbe(usable=usable, reason=reason, boot_id=current_boot)


def format_cache(answer: KvmProbe) -> str:
    return json.dumps(attrs.asdict(answer), sort_keys=True) + "\n"


# -- step 2: a tiny guest, through the KVM ioctls ----------------------------------------------

_KVM_GET_API_VERSION = 0xAE00
_KVM_CREATE_VM = 0xAE01
_KVM_GET_VCPU_MMAP_SIZE = 0xAE04
_KVM_CREATE_VCPU = 0xAE41
_KVM_SET_USER_MEMORY_REGION = 0x4020AE46
_KVM_RUN = 0xAE80
_KVM_SET_REGS = 0x4090AE82
_KVM_GET_SREGS = 0x8138AE83
_KVM_SET_SREGS = 0x4138AE84
_KVM_EXIT_IO, _KVM_EXIT_HLT = 2, 5
# mov dx, 0x3f8; mov al, 'K'; out dx, al; hlt
_TINY_CODE = bytes.fromhex("baf803b04beef4")


def _ioctl(fd: int, request: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    r = int(libc.ioctl(fd, request, arg))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


def tiny_guest() -> str:
    """Run the tiny guest in this process; the exits it took, as text ("io K, hlt")."""
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    vm = _ioctl(kvm, _KVM_CREATE_VM)
    mem = mmap.mmap(-1, 0x10000)
    mem[0x1000 : 0x1000 + len(_TINY_CODE)] = _TINY_CODE
    host = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    region = ctypes.create_string_buffer(struct.pack("IIQQQ", 0, 0, 0, 0x10000, host))
    _ioctl(vm, _KVM_SET_USER_MEMORY_REGION, ctypes.addressof(region))
    vcpu = _ioctl(vm, _KVM_CREATE_VCPU)
    run = mmap.mmap(vcpu, _ioctl(kvm, _KVM_GET_VCPU_MMAP_SIZE))
    sregs = ctypes.create_string_buffer(312)
    _ioctl(vcpu, _KVM_GET_SREGS, ctypes.addressof(sregs))
    struct.pack_into("QIH", sregs, 0, 0, 0xFFFF, 0)  # cs: base 0, selector 0
    _ioctl(vcpu, _KVM_SET_SREGS, ctypes.addressof(sregs))
    regs = bytearray(144)
    struct.pack_into("QQ", regs, 16 * 8, 0x1000, 0x2)  # rip, rflags
    regs_buf = ctypes.create_string_buffer(bytes(regs))
    _ioctl(vcpu, _KVM_SET_REGS, ctypes.addressof(regs_buf))
    seen = []
    for _ in range(2):
        _ioctl(vcpu, _KVM_RUN)
        reason = struct.unpack_from("I", run, 8)[0]
        if reason == _KVM_EXIT_IO:
            offset = struct.unpack_from("Q", run, 40)[0]
            seen.append(f"io {chr(run[offset])}")
        else:
            seen.append("hlt" if reason == _KVM_EXIT_HLT else f"exit {reason}")
    return ", ".join(seen)


def _run_tiny_guest() -> str | None:
    """The tiny guest in a child process (a KVM_RUN that never returns cannot hang feosd);
    None if it ran as it should, else what went wrong."""
    # the child finds feos where this process did: the packages' programs put their own
    # directory (/usr/lib/feos/python) on sys.path, which a plain interpreter does not have
    where = str(Path(__file__).resolve().parents[2])
    code = (f"import sys; sys.path.insert(0, {where!r}); "
            "from feos.vmm._kvm import tiny_guest; print(tiny_guest())")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=TINY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"a tiny guest did not halt within {TINY_TIMEOUT_S:g}s"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"a tiny guest failed: {lines[-1] if lines else done.returncode}"
    if done.stdout.strip() != "io K, hlt":
        return f"a tiny guest took the wrong exits: {done.stdout.strip()}"
    return None


# -- step 3: boot a real kernel under QEMU with KVM --------------------------------------------


def _newest_guest_kernel() -> Path | None:
    root = Path(os.environ.get("FEOS_GUEST_DIR", "/usr/lib/feos/guest"))
    try:
        kernels = [d / "vmlinux" for d in root.iterdir() if (d / "vmlinux").is_file()]
    except OSError:
        return None
    return max(kernels, key=lambda p: p.stat().st_mtime, default=None)


def boot_argv(qemu: str, kernel: Path) -> list[str]:
    """QEMU booting `kernel` under KVM with no root: reaching init is all it has to show."""
    return [qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot",
            "-kernel", str(kernel), "-append", "console=ttyS0 reboot=t panic=-1 quiet=0"]


def judge_boot(output: str, returncode: int | None) -> str | None:
    """None if the console shows the kernel at init, else why KVM failed (the last line)."""
    if any(m in output for m in _BOOT_MARKERS):
        return None
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    last = (errors or lines or ["no output"])[-1]
    if returncode is None:
        return f"a guest kernel did not reach init under KVM within {BOOT_TIMEOUT_S:g}s"
    return f"a guest kernel cannot boot under KVM: {last}"


def _boot_kernel(kernel: Path) -> str | None:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        return None
    try:
        done = subprocess.run(boot_argv(qemu, kernel), capture_output=True, text=True,
                              timeout=BOOT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        return judge_boot(out, None)
    return judge_boot(done.stdout + done.stderr, done.returncode)


# -- step 4: the failure modes known without a kernel to boot ----------------------------------


def known_failure(sys_module: Path = Path("/sys/module"),
                  cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    if (sys_module / "kvm_pvm").exists():
        return "KVM here is PVM (kvm_pvm): stock guest kernels cannot finish booting"
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    if not flags & {"vmx", "svm"}:
        return "the CPU has no vmx or svm: KVM cannot run guests in hardware"
    return None


def probe() -> KvmProbe:
    """Run the probe (blocking, up to about 25 s): the steps of the module's comment."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return KvmProbe(False, f"/dev/kvm: {e.strerror}", boot_id())
    try:
        api = _ioctl(fd, _KVM_GET_API_VERSION)
    finally:
        os.close(fd)
    if api != 12:
        return KvmProbe(False, f"/dev/kvm speaks KVM API {api}, not 12", boot_id())
    failed = _run_tiny_guest()
    if failed is None:
        kernel = _newest_guest_kernel()
        if kernel is not None and shutil.which("qemu-system-x86_64"):
            failed = _boot_kernel(kernel)
            if failed is None:
                return KvmProbe(True, f"{kernel} reached init under KVM", boot_id())
        else:
            failed = known_failure()
    if failed is not None:
        return KvmProbe(False, failed, boot_id())
    return KvmProbe(True, "KVM runs a tiny guest and the CPU virtualises in hardware", boot_id())


def kvm_probe(cache: Path = CACHE) -> KvmProbe:
    """The answer for this boot of the host: cached, else probed and kept."""
    current = boot_id()
    try:
        cached = parse_cache(cache.read_text(), current)
    except OSError:
        cached = None
    if cached is not None:
        return cached
    answer = probe()
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        tmp.write_text(format_cache(answer))
        tmp.replace(cache)
    except OSError:
        pass  # not kept: asked again next time, which is only slower
    return answer


async def kvm_probe_async(cache: Path = CACHE) -> KvmProbe:
    """kvm_probe on a worker thread: the probe can take seconds."""
    return await trio.to_thread.run_sync(kvm_probe, cache)
