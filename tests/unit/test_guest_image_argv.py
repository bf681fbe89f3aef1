"""feos.vmm._qemu_argv: the microvm command line and the host TSC parsers."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.vmm._qemu_argv import (
    Drive,
    QemuConfig,
    Tap,
    kernel_cmdline,
    microvm_firmware,
    qemu_argv,
    tsc_khz_from_cpuinfo,
    tsc_khz_from_kmsg,
)


def _config(**kw: object) -> QemuConfig:
    base: dict[str, object] = {
        "kernel": "/g/vmlinux",
        "initramfs": "/g/initramfs",
        "cmdline": "console=ttyS0",
    }
    return QemuConfig(**{**base, **kw})  # type: ignore[arg-type]


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_minimal_config_boots_a_microvm_with_rng_and_balloon() -> None:
    argv = qemu_argv(_config())
    assert argv[0] == "qemu-system-x86_64"
    assert _pairs(argv, "-M") == ["microvm,x-option-roms=off"]
    assert _pairs(argv, "-bios") == ["qboot.rom"]
    assert _pairs(argv, "-accel") == ["tcg"]
    assert _pairs(argv, "-cpu") == ["max"]
    assert _pairs(argv, "-kernel") == ["/g/vmlinux"]
    assert _pairs(argv, "-initrd") == ["/g/initramfs"]
    assert _pairs(argv, "-append") == ["console=ttyS0"]
    assert _pairs(argv, "-smp") == ["1"]
    assert _pairs(argv, "-m") == ["512M"]
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    devices = _pairs(argv, "-device")
    assert "virtio-rng-device,rng=rng0" in devices
    assert "virtio-balloon-device,free-page-reporting=on" in devices
    assert _pairs(argv, "-serial") == ["null"]
    for flag in ("-qmp", "-incoming", "-chroot", "-runas", "-sandbox", "-netdev"):
        assert flag not in argv


def test_drives_keep_their_order_serials_and_modes() -> None:
    drives = (Drive("/g/root.erofs", "root", read_only=True), Drive("/d/data", "data"),
              Drive("/d/v1", "vol1", discard=False))  # fmt: skip
    argv = qemu_argv(_config(drives=drives))
    cache = "if=none,cache=writeback,werror=report,rerror=report"
    assert _pairs(argv, "-drive") == [
        f"id=drive0,file=/g/root.erofs,format=raw,{cache},read-only=on",
        f"id=drive1,file=/d/data,format=raw,{cache},discard=unmap",
        f"id=drive2,file=/d/v1,format=raw,{cache}",
    ]
    blk = [d for d in _pairs(argv, "-device") if d.startswith("virtio-blk-device")]
    assert blk == [f"virtio-blk-device,drive=drive{i},serial={s}"
                   for i, s in enumerate(["root", "data", "vol1"])]  # fmt: skip


def test_link_tap_qmp_serial_and_host_options() -> None:
    argv = qemu_argv(_config(
        link_socket="/vm/guest.sock", tap=Tap("pod-abc", "06:00:01:02:03:04"),
        qmp_socket="/vm/qmp.sock", serial_log="/vm/serial.log", incoming="/vm/snap shot",
        chroot="/vm", runas="vm-1", sandbox=True, vcpus=2, memory_mib=1024, accel="kvm",
        name="abc",
    ))  # fmt: skip
    assert _pairs(argv, "-chardev") == ["socket,id=guest,path=/vm/guest.sock,server=on,wait=off"]
    devices = _pairs(argv, "-device")
    assert "virtio-serial-device" in devices
    assert "virtserialport,chardev=guest,name=feos.guest" in devices
    assert "virtio-net-device,netdev=net0,mac=06:00:01:02:03:04" in devices
    netdev = "tap,id=net0,ifname=pod-abc,script=no,downscript=no,vhost=off"
    assert _pairs(argv, "-netdev") == [netdev]
    assert _pairs(argv, "-qmp") == ["unix:/vm/qmp.sock,server=on,wait=off"]
    assert _pairs(argv, "-serial") == ["file:/vm/serial.log"]
    incoming = _pairs(argv, "-incoming")[0]
    assert incoming.startswith("exec:")
    assert shlex.split(incoming.removeprefix("exec:")) == ["cat", "/vm/snap shot"]
    assert _pairs(argv, "-chroot") == ["/vm"]
    assert _pairs(argv, "-runas") == ["vm-1"]
    assert "spawn=deny" not in _pairs(argv, "-sandbox")[0]
    assert _pairs(argv, "-cpu") == ["host"]
    assert _pairs(argv, "-smp") == ["2"]
    assert _pairs(argv, "-m") == ["1024M"]


def test_a_qemu_of_9_1_on_is_confined_by_run_with() -> None:
    """QEMU 9.1 removed -chroot and -runas (Debian 13's QEMU): -run-with takes both."""
    argv = qemu_argv(_config(chroot="/vm", runas="1000:1000", run_with=True))
    assert _pairs(argv, "-run-with") == ["chroot=/vm,user=1000:1000"]
    assert "-chroot" not in argv and "-runas" not in argv
    assert _pairs(qemu_argv(_config(runas="7:7", run_with=True)), "-run-with") == ["user=7:7"]


def test_qboot_boots_without_option_roms_and_the_default_firmware_with_them() -> None:
    """qboot loads the kernel itself; QEMU's default microvm firmware (SeaBIOS on Debian 13)
    boots it only through the option ROMs, so x-option-roms=off goes with qboot alone."""
    qboot = qemu_argv(_config())
    assert qboot[1:5] == ["-M", "microvm,x-option-roms=off", "-bios", "qboot.rom"]
    default = qemu_argv(_config(firmware=None))
    assert default[1:3] == ["-M", "microvm"]
    assert "-bios" not in default
    assert [a for a in default if "option-roms" in a] == []
    assert qboot[5:] == default[3:]  # the rest of the command line is the same


def test_the_firmware_is_qboot_where_qemus_data_directories_have_it(tmp_path: Path) -> None:
    share, seabios = tmp_path / "qemu", tmp_path / "seabios"
    for d in (share, seabios):
        d.mkdir()
    (seabios / "bios-microvm.bin").write_bytes(b"seabios")
    assert microvm_firmware([str(share), str(seabios)]) is None
    assert microvm_firmware([]) is None
    (share / "qboot.rom").write_bytes(b"qboot")
    assert microvm_firmware([str(tmp_path / "missing"), str(share), str(seabios)]) == "qboot.rom"


@pytest.mark.parametrize(
    "kw",
    [
        {"vcpus": 0},
        {"vcpus": 33},
        {"memory_mib": 32},
        {"kernel": "/a,b"},
        {"link_socket": "/x,y"},
        {"link_name": "bad name"},
        {"firmware": "q,boot.rom"},
        {"drives": (Drive("/a", "root"), Drive("/b", "root"))},
    ],
)
def test_bad_configs_are_invalid_argument(kw: dict[str, object]) -> None:
    with pytest.raises(FeosError) as e:
        _config(**kw)
    assert e.value.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("cls", "args"),
    [(Drive, ("/a", "x" * 21)), (Drive, ("/a,b", "root")), (Tap, ("t", "06:00:01:02:03")),
     (Tap, ("t,x", "06:00:01:02:03:04"))],
)  # fmt: skip
def test_bad_drives_and_taps_are_invalid_argument(cls: type, args: tuple[str, str]) -> None:
    with pytest.raises(FeosError) as e:
        cls(*args)
    assert e.value.code == Code.INVALID_ARGUMENT


def test_kernel_cmdline_follows_the_contract() -> None:
    assert kernel_cmdline(2596144, "feos.guest") == (
        "console=ttyS0 reboot=t panic=-1 tsc_early_khz=2596144 feos.link=feos.guest"
    )
    assert kernel_cmdline(None, "vsock", "feos.floor=shell").endswith(
        "panic=-1 feos.link=vsock feos.floor=shell"
    )


KMSG = """\
[Firmware Bug]: TSC doesn't count with P0 frequency!
tsc: Detected 2596.144 MHz processor
clocksource: tsc-early: mask: 0xffffffffffffffff
"""


def test_tsc_from_the_kernel_log() -> None:
    assert tsc_khz_from_kmsg(KMSG) == 2596144
    refined = KMSG + "tsc: Refined TSC clocksource calibration: 2596.0991 MHz\n"
    assert tsc_khz_from_kmsg(refined) == 2596099
    assert tsc_khz_from_kmsg("nothing here") is None


def test_tsc_from_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: X\ncpu MHz\t\t: 2596.144\ncache size\t: 512 KB\n"
    assert tsc_khz_from_cpuinfo(text) == 2596144
    assert tsc_khz_from_cpuinfo("cpu MHz\t\t: 3000\n") == 3000000
    assert tsc_khz_from_cpuinfo("flags: tsc\n") is None


@given(st.integers(1, 99999), st.integers(0, 999))
def test_tsc_parsers_read_every_frequency(mhz: int, frac: int) -> None:
    text = f"{mhz}.{frac:03d}"
    assert tsc_khz_from_kmsg(f"tsc: Detected {text} MHz processor") == mhz * 1000 + frac
    assert tsc_khz_from_cpuinfo(f"cpu MHz\t: {text}\n") == mhz * 1000 + frac


@given(st.text())
def test_tsc_parsers_take_any_text(text: str) -> None:
    for parse in (tsc_khz_from_kmsg, tsc_khz_from_cpuinfo):
        khz = parse(text)
        assert khz is None or khz >= 0


def test_a_diskd_top_is_opened_as_qcow2_and_other_formats_are_refused() -> None:
    argv = qemu_argv(_config(drives=(Drive("data", "data", format="qcow2"),)))
    assert _pairs(argv, "-drive")[0].startswith("id=drive0,file=data,format=qcow2,")
    with pytest.raises(FeosError) as caught:
        Drive("data", "data", format="vmdk")
    assert caught.value.code is Code.INVALID_ARGUMENT
