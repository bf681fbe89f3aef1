"""The QEMU `-M microvm` command line of a pod's microVM, built from a frozen config.

Pure: `qemu_argv(config)` returns the argv and touches nothing; `kernel_cmdline` writes the guest
contract's kernel command line. Two functions here read the host: `host_tsc_khz` (the TSC
frequency every TCG boot needs as tsc_early_khz, or one boot in eleven hangs), whose parsers are
pure, and `microvm_firmware` (whether QEMU's data directories have qboot).

Device order matters to the guest: drives come in the config's order (root, data, vol1, ...),
each a virtio-blk-device with its serial, so that the guest finds them by /sys/block/vd*/serial.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Literal

import attrs

from feos.errors import Code, FeosError

_SERIAL_RE = re.compile(r"[A-Za-z0-9._-]{1,20}")  # virtio-blk serials are 20 bytes at most
_MAC_RE = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
_PORT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _check(field: str, value: str, pattern: re.Pattern[str] | None = None) -> None:
    # QEMU's option syntax splits on commas (a literal one is written twice): we refuse them
    # rather than escape, since no path or name feosd makes has one.
    bad = "," in value or "\n" in value or not value
    if bad or (pattern is not None and not pattern.fullmatch(value)):
        raise FeosError(Code.INVALID_ARGUMENT, f"{field}: {value!r} is not valid here")


@attrs.frozen
class Drive:
    """A virtio-blk drive: a file the VMM opens, the serial the guest finds it by."""

    path: str
    serial: str
    read_only: bool = False
    # discard=unmap: a guest's fstrim punches holes in a sparse disk file.
    discard: bool = True
    format: str = "raw"  # or "qcow2": a diskd top, whose backing chain QEMU opens itself

    def __attrs_post_init__(self) -> None:
        _check("drive.path", self.path)
        _check("drive.serial", self.serial, _SERIAL_RE)
        if self.format not in ("raw", "qcow2"):
            raise FeosError(Code.INVALID_ARGUMENT, f"drive.format: {self.format!r} is not "
                            "raw or qcow2")


@attrs.frozen
class Tap:
    """The pod's TAP device (made beforehand, by the network layer) and the guest's MAC."""

    name: str
    mac: str

    def __attrs_post_init__(self) -> None:
        _check("tap.name", self.name)
        _check("tap.mac", self.mac, _MAC_RE)


QBOOT = "qboot.rom"  # the microVMs' firmware, by its name in QEMU's data directories

@attrs.frozen
class QemuConfig:
    """What one QEMU microVM runs with. Paths are as QEMU sees them (inside -chroot, if set)."""

    kernel: str  # the ELF vmlinux: microvm boots it by PVH
    initramfs: str
    cmdline: str
    vcpus: int = 1
    memory_mib: int = 512
    drives: tuple[Drive, ...] = ()
    link_socket: str | None = None  # guest.sock; QEMU is its server
    link_name: str = "feos.guest"  # the virtserialport's name, which the guest looks for
    tap: Tap | None = None
    qmp_socket: str | None = None
    serial_log: str | None = None  # the guest's ttyS0; None: discarded
    rng: bool = True  # virtio-rng: Python's start would otherwise wait about 1 s for entropy
    balloon: bool = True  # with free page reporting: the guest hands freed memory back
    accel: Literal["tcg", "kvm"] = "tcg"
    cpu: str | None = None  # None: "max" under TCG (RDRAND, SSE4.2), "host" under KVM
    incoming: str | None = None  # a migration file to resume from (QEMU waits in "inmigrate")
    chroot: str | None = None
    runas: str | None = None
    run_with: bool = False  # QEMU 9.1 on: -run-with chroot=,user= (-chroot and -runas are gone)
    # The firmware, by its name in QEMU's data directories: qboot loads the PVH kernel from
    # fw_cfg itself, so no option ROM is needed (x-option-roms=off). None: QEMU's default
    # microvm firmware, SeaBIOS where Debian 13 installs it, with the option ROMs that load the
    # kernel (without them it finds no boot disk and stops at "No bootable device").
    firmware: str | None = QBOOT
    sandbox: bool = False
    name: str | None = None
    no_reboot: bool = True  # a guest's reboot ends QEMU: the node restarts a VM, not QEMU
    qemu: str = "qemu-system-x86_64"

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.vcpus <= 32:
            raise FeosError(Code.INVALID_ARGUMENT, f"vcpus: {self.vcpus} is not 1 to 32")
        if self.memory_mib < 64:
            raise FeosError(Code.INVALID_ARGUMENT, f"memory_mib: {self.memory_mib} is below 64")
        serials = [d.serial for d in self.drives]
        if len(set(serials)) != len(serials):
            raise FeosError(Code.INVALID_ARGUMENT, f"drives: serials repeat: {serials}")
        _check("kernel", self.kernel)
        _check("initramfs", self.initramfs)
        _check("link_name", self.link_name, _PORT_RE)
        for field in ("link_socket", "qmp_socket", "serial_log", "chroot", "runas", "name",
                      "firmware"):
            value = getattr(self, field)
            if value is not None:
                _check(field, value)


def qemu_argv(config: QemuConfig) -> list[str]:
    """The full argv (program first) of QEMU for `config`."""
    c = config
    argv = [c.qemu, *_machine(c), "-kernel", c.kernel, "-initrd", c.initramfs, "-append", c.cmdline]
    for i, drive in enumerate(c.drives):
        argv += _drive(i, drive)
    if c.link_socket is not None:
        argv += [
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=guest,path={c.link_socket},server=on,wait=off",
            "-device", f"virtserialport,chardev=guest,name={c.link_name}",
        ]  # fmt: skip
    if c.tap is not None:
        argv += [
            "-netdev", f"tap,id=net0,ifname={c.tap.name},script=no,downscript=no,vhost=off",
            "-device", f"virtio-net-device,netdev=net0,mac={c.tap.mac}",
        ]  # fmt: skip
    if c.rng:
        argv += ["-object", "rng-random,id=rng0,filename=/dev/urandom",
                 "-device", "virtio-rng-device,rng=rng0"]  # fmt: skip
    if c.balloon:
        argv += ["-device", "virtio-balloon-device,free-page-reporting=on"]
    argv += _host_side(c)
    return argv


def _machine(c: QemuConfig) -> list[str]:
    cpu = c.cpu or ("max" if c.accel == "tcg" else "host")
    # qboot enters the PVH kernel directly: no option ROMs to load (x-option-roms=off).
    machine = ["-M", "microvm,x-option-roms=off", "-bios", c.firmware] if c.firmware else [
        "-M", "microvm"]
    argv = [*machine, "-accel", c.accel, "-cpu", cpu, "-smp", str(c.vcpus),
            "-m", f"{c.memory_mib}M", "-nodefaults", "-no-user-config", "-nographic"]  # fmt: skip
    if c.no_reboot:
        argv.append("-no-reboot")
    if c.name is not None:
        argv += ["-name", c.name]
    return argv


def _drive(index: int, d: Drive) -> list[str]:
    # cache=writeback: the host's page cache, and the guest's flushes honoured (a qcow2 top's
    # flush writes its tables and fdatasyncs it): what the guest flushed is on stable storage.
    # werror/rerror=report: a full disk fails the guest's write with an I/O error (QEMU's
    # default, enospc, would pause the whole microVM), and nothing it flushed before is lost.
    opts = (f"id=drive{index},file={d.path},format={d.format},if=none,cache=writeback,"
            "werror=report,rerror=report")
    if d.read_only:
        opts += ",read-only=on"
    elif d.discard:
        opts += ",discard=unmap"
    return ["-drive", opts, "-device", f"virtio-blk-device,drive=drive{index},serial={d.serial}"]


def _host_side(c: QemuConfig) -> list[str]:
    argv = ["-serial", f"file:{c.serial_log}" if c.serial_log is not None else "null"]
    if c.qmp_socket is not None:
        argv += ["-qmp", f"unix:{c.qmp_socket},server=on,wait=off"]
    if c.incoming is not None:
        # QEMU 7.2 has no file: migration URI; exec: runs through /bin/sh, hence the quoting.
        argv += ["-incoming", f"exec:cat {shlex.quote(c.incoming)}"]
    if c.run_with:
        parts = ([f"chroot={c.chroot}"] if c.chroot is not None else []) + (
            [f"user={c.runas}"] if c.runas is not None else [])
        argv += ["-run-with", ",".join(parts)] if parts else []
    else:
        if c.chroot is not None:
            argv += ["-chroot", c.chroot]
        if c.runas is not None:
            argv += ["-runas", c.runas]
    if c.sandbox:
        # spawn stays allowed: suspend and -incoming run `cat` through exec: migration. QEMU
        # drops to -runas after it installs the filter, so set*id stays allowed with -runas
        # (denied, QEMU dies of SIGSYS; measured).
        privileges = "" if c.runas is not None else ",elevateprivileges=deny"
        argv += ["-sandbox", f"on,obsolete=deny{privileges},resourcecontrol=deny"]
    return argv


def microvm_firmware(data_dirs: list[str]) -> str | None:
    """qboot where one of QEMU's data directories (as `qemu -L help` lists them) has it, else
    None: QEMU's default firmware then, with its option ROMs. Debian 12 links its microvm
    default to qboot; Debian 13's default is SeaBIOS, which boots nothing without the ROMs."""
    return QBOOT if any(os.path.isfile(os.path.join(d, QBOOT)) for d in data_dirs) else None


def kernel_cmdline(tsc_khz: int | None, link: str = "feos.guest", *extra: str) -> str:
    """The guest contract's kernel command line; `extra` words (as feos.floor=shell) go last."""
    words = ["console=ttyS0", "reboot=t", "panic=-1"]
    if tsc_khz is not None:
        words.append(f"tsc_early_khz={tsc_khz}")
    words.append(f"feos.link={link}")
    return " ".join([*words, *extra])


_KMSG_REFINED = re.compile(r"Refined TSC clocksource calibration: (\d+)\.(\d{1,3})\d* MHz")
_KMSG_DETECTED = re.compile(r"tsc: Detected (\d+)\.(\d{1,3})\d* MHz")
_CPUINFO_MHZ = re.compile(r"^cpu MHz\s*:\s*(\d+)(?:\.(\d{1,3})\d*)?\s*$", re.MULTILINE)


def _khz(mhz: str, frac: str | None) -> int:
    return int(mhz) * 1000 + int((frac or "0").ljust(3, "0"))


def tsc_khz_from_kmsg(text: str) -> int | None:
    """The TSC kHz the host kernel logged: its refined calibration, else its first detection."""
    refined = list(_KMSG_REFINED.finditer(text))
    m = refined[-1] if refined else _KMSG_DETECTED.search(text)
    return None if m is None else _khz(m.group(1), m.group(2))


def tsc_khz_from_cpuinfo(text: str) -> int | None:
    """The first "cpu MHz" of /proc/cpuinfo in kHz (the TSC's where frequency scaling is off)."""
    m = _CPUINFO_MHZ.search(text)
    return None if m is None else _khz(m.group(1), m.group(2))


def host_tsc_khz() -> int | None:
    """The host's TSC in kHz from the kernel log (/dev/kmsg), else /proc/cpuinfo, else None."""
    khz = tsc_khz_from_kmsg(_read_kmsg())
    if khz is None:
        try:
            with open("/proc/cpuinfo") as f:
                khz = tsc_khz_from_cpuinfo(f.read())
        except OSError:
            return None
    return khz if khz and khz > 0 else None


def _read_kmsg() -> str:
    """The kernel log's records still in its buffer (empty when /dev/kmsg is not readable)."""
    lines: list[str] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # a record was overwritten while we read: go on
                continue
            if not record:
                break
            lines.append(record.decode("utf-8", "replace").partition(";")[2])
    except OSError:
        pass
    finally:
        os.close(fd)
    return "".join(lines)
