"""Firecracker's tiny test kernels, and a jailed Firecracker to run them, for tests and benches.

This host's /dev/kvm is PVM, on which no stock guest kernel finishes booting (environment.md), so
Firecracker runs kernels of a few instructions of our own here (and slowly: a memory access of
its guest costs microseconds under PVM, 64 MiB written word by word took 36 s, hence the stride):

- `tiny_kernel()` writes "FEOS-TINY" to COM1 and halts;
- `pattern_kernel()` writes a known pattern (a word of 8 bytes, its address XOR PATTERN_KEY,
  every PATTERN_STRIDE bytes: 16 in every page) over PATTERN_BYTES of its memory from
  PATTERN_START, prints "W", then reads the whole of it again and again, printing "K" after each pass that found every word right and "B" (and halting) at
  the first that is not. A snapshot taken while it runs and restored elsewhere goes on reading:
  the first "K" after the restore says the whole share came back as it was.

`firecracker_root()` is the pinned Firecracker (installed by hack/firecracker where missing);
`cgroup_parents()` makes throwaway v1 cgroup parents and removes them with what is left in them;
`pattern_vm(...)` boots the pattern kernel in a jail and deletes it at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import trio

from feos.vmm import _cgroup as cg
from feos.vmm import _jail
from feos.vmm._driver import VmHandle, VmSpec
from feos.vmm._firecracker import FirecrackerDriver

REPO = Path(__file__).resolve().parents[1]
VERSION = "v1.12.1"
CGROUPS = Path("/sys/fs/cgroup")
TINY_TEXT = b"FEOS-TINY"
PATTERN_START = 0x1000000  # 16 MiB: above the kernel (1 MiB) and Firecracker's page tables
PATTERN_BYTES = 64 << 20
PATTERN_KEY = 0x9E3779B97F4A7C15
PATTERN_STRIDE = 256  # bytes from one pattern word to the next: 16 in every page
PATTERN_MEMORY_MIB = 128
PATTERN_WRITTEN, PATTERN_OK, PATTERN_BAD = b"W\n", b"K\n", b"B\n"
_COM1_OUT = b"\x66\xba\xf8\x03"  # mov dx, 0x3f8


def elf_kernel(code: bytes) -> bytes:
    """An ELF64 x86-64 kernel of `code` loaded (and entered, in long mode) at 1 MiB."""
    entry, phoff = 0x100000, 64
    offset = 0x1000
    ehdr = struct.pack("<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, 2, 62, 1,
                       entry, phoff, 0, 0, 64, 56, 1, 64, 0, 0)  # fmt: skip
    phdr = struct.pack("<IIQQQQQQ", 1, 7, offset, entry, entry, len(code), len(code), 0x1000)
    return (ehdr + phdr).ljust(offset, b"\0") + code


def _say(text: bytes) -> bytes:
    """Code that writes text to COM1 (dx and al clobbered)."""
    code = _COM1_OUT
    for ch in text:
        code += b"\xb0" + bytes([ch]) + b"\xee"  # mov al, ch; out dx, al
    return code


def tiny_kernel() -> bytes:
    """Writes TINY_TEXT to COM1, then halts for ever."""
    return elf_kernel(_say(TINY_TEXT + b"\n") + b"\xf4\xeb\xfd")  # hlt; jmp hlt


def pattern_kernel(fill_bytes: int = PATTERN_BYTES, check_bytes: int = PATTERN_BYTES) -> bytes:
    """The pattern's writer (over fill_bytes from PATTERN_START) and reader (over the first
    check_bytes of it), as the module docstring says. Assembled from:

        mov rdi, START; mov rcx, START + FILL; movabs rbx, KEY
    fill:  mov rdx, rdi; xor rdx, rbx; mov [rdi], rdx; add rdi, STRIDE; cmp rdi, rcx; jb fill
        (say "W\\n"); mov rcx, START + CHECK
    check: mov rdi, START
    loop:  mov rdx, rdi; xor rdx, rbx; cmp [rdi], rdx; jne bad; add rdi, STRIDE; cmp rdi, rcx
           jb loop
        (say "K\\n"); jmp check
    bad:   (say "B\\n"); hlt; jmp hlt
    """
    start = b"\x48\xc7\xc7" + struct.pack("<I", PATTERN_START)  # mov rdi, imm32
    fill_end = b"\x48\xc7\xc1" + struct.pack("<I", PATTERN_START + fill_bytes)  # mov rcx, imm32
    check_end = b"\x48\xc7\xc1" + struct.pack("<I", PATTERN_START + check_bytes)
    key = b"\x48\xbb" + struct.pack("<Q", PATTERN_KEY)  # movabs rbx, imm64
    word = b"\x48\x89\xfa\x48\x31\xda"  # mov rdx, rdi; xor rdx, rbx
    step = b"\x48\x81\xc7" + struct.pack("<I", PATTERN_STRIDE) + b"\x48\x39\xcf"  # add; cmp
    fill = word + b"\x48\x89\x17" + step  # ... mov [rdi], rdx ...
    fill += b"\x72" + bytes([(-(len(fill) + 2)) & 0xFF])  # jb fill
    say_ok, say_bad = _say(PATTERN_OK), _say(PATTERN_BAD)
    check_body = word + b"\x48\x39\x17"  # cmp [rdi], rdx
    jne = b"\x75" + bytes([len(step) + 2 + len(say_ok) + 2])  # over the rest to bad
    loop_len = len(check_body) + len(jne) + len(step) + 2
    loop = check_body + jne + step + b"\x72" + bytes([(-loop_len) & 0xFF])  # jb loop
    check = start + loop + say_ok
    check += b"\xeb" + bytes([(-(len(check) + 2)) & 0xFF])  # jmp check
    code = (start + fill_end + key + fill + _say(PATTERN_WRITTEN) + check_end + check + say_bad
            + b"\xf4\xeb\xfd")  # fmt: skip
    return elf_kernel(code)


def firecracker_root() -> Path:
    """The pinned Firecracker, installed by hack/firecracker where it is missing."""
    root = Path(os.environ.get(_jail.FIRECRACKER_DIR_ENV) or _jail.FIRECRACKER_ROOT)
    if not (root / VERSION / "jailer").exists():
        prefix = root.parents[3] if root.parts[-4:] == ("usr", "lib", "feos", "firecracker") \
            else Path("/")  # fmt: skip
        subprocess.run([str(REPO / "hack" / "firecracker"), "--prefix", str(prefix)],
                       check=True, capture_output=True)  # fmt: skip
    assert any(i.version == VERSION for i in _jail.installed(root))
    return root


@contextlib.contextmanager
def cgroup_parents() -> Iterator[dict[str, Path]]:
    """Throwaway v1 cgroup parents, removed at the end with whatever still runs in them."""
    name = f"feostest-{secrets.token_hex(4)}"
    bases = {h: CGROUPS / h / name for h in cg.V1_HIERARCHIES if (CGROUPS / h / "tasks").exists()}
    for d in bases.values():
        d.mkdir()
    try:
        yield bases
    finally:
        for d in bases.values():
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                for pid in cg.pids_in(sub):
                    os.kill(pid, 9)
                sub.rmdir()
            d.rmdir()


def serial_after(driver: FirecrackerDriver, vm: VmHandle, offset: int, text: bytes,
                 within: float) -> bytes:  # fmt: skip
    """serial.log from `offset` once it holds `text` (or PATTERN_BAD: the caller asserts)."""
    log = driver.directory(vm.id) / "serial.log"
    deadline = time.monotonic() + within
    while True:
        seen = log.read_bytes()[offset:]
        if text in seen or PATTERN_BAD in seen:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not on the serial console within {within:g}s: "
                                 f"{seen[-200:]!r}")  # fmt: skip
        time.sleep(0.002)


def serial_size(driver: FirecrackerDriver, vm: VmHandle) -> int:
    log = driver.directory(vm.id) / "serial.log"
    return log.stat().st_size if log.exists() else 0


@contextlib.contextmanager
def pattern_vm(state_dir: Path, guest_dir: Path, bases: dict[str, Path], *,
               memory_mib: int = PATTERN_MEMORY_MIB, fill_bytes: int = PATTERN_BYTES,
               ) -> Iterator[tuple[FirecrackerDriver, VmHandle]]:  # fmt: skip
    """The pattern kernel booted in a jail (its pattern written and read once), deleted at the
    end; no network."""
    guest_dir.mkdir(parents=True, exist_ok=True)
    (guest_dir / "vmlinux").write_bytes(pattern_kernel(fill_bytes))
    with open(guest_dir / "root.erofs", "wb") as f:
        f.truncate(1 << 20)
    driver = FirecrackerDriver(state_dir, cgroups=cg.V1Layout(bases=bases), tsc_khz=2596144)
    vm_id = f"fcp-{secrets.token_hex(4)}"
    vm = VmHandle(id=vm_id, spec=VmSpec(vcpus=1, memory_mib=memory_mib),
                  directory=driver.directory(vm_id), guest_version="pattern",
                  guest_dir=guest_dir, accel="kvm")  # fmt: skip

    async def boot() -> None:
        await driver.prepare(vm)
        await driver.start(vm, within=10)

    try:
        trio.run(boot)
        serial_after(driver, vm, 0, PATTERN_WRITTEN + PATTERN_OK, 60)
        yield driver, vm
    finally:
        trio.run(driver.delete, vm)
