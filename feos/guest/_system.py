"""The guest's own machine: clock, network, volumes, the data volume's freeze, memory, power.

The pure parts (the ip commands of a network configuration, a drive's name) are functions of
their inputs; the rest runs commands through the Reaper or does one syscall.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Any

from feos.errors import Code, FeosError

from . import _proc

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
SLEW_LIMIT_NS = 500_000_000  # adjtime's own bound: larger offsets are stepped
ADJ_OFFSET_SINGLESHOT = 0x8001
IPV6_GATEWAY = "fe80::1"
IPV4_GATEWAY = "169.254.0.1"


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


# Time ------------------------------------------------------------------------------------------


def set_time(ns: int) -> None:
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)
    except OSError as e:
        raise FeosError(Code.PERMISSION_DENIED if e.errno == errno.EPERM else Code.INTERNAL,
                        f"clock_settime: {e.strerror}") from None  # fmt: skip


def adjust_time(offset_ns: int) -> bool:
    """Slews the clock by offset_ns with adjtimex if it is small, else steps it; True if slewed."""
    if abs(offset_ns) > SLEW_LIMIT_NS:
        set_time(time.time_ns() + offset_ns)
        return False
    import ctypes  # only here: its import costs boot time

    timex = (ctypes.c_long * 64)()  # struct timex is 208 bytes: modes (int) at 0, offset at 8
    ctypes.c_int.from_buffer(timex).value = ADJ_OFFSET_SINGLESHOT
    timex[1] = offset_ns // 1000  # microseconds with ADJ_OFFSET_SINGLESHOT
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.adjtimex(ctypes.byref(timex)) < 0:
        err = ctypes.get_errno()
        raise FeosError(Code.PERMISSION_DENIED if err == errno.EPERM else Code.INTERNAL,
                        f"adjtimex: {os.strerror(err)}")  # fmt: skip
    return True


# Network ---------------------------------------------------------------------------------------


def is_ula(addr: bytes) -> bool:
    return len(addr) == 16 and addr[0] & 0xFE == 0xFC


def network_commands(dev: str, ipv6: str, ipv6_ula: bool, ipv4: str, mtu: int) -> list[list[str]]:
    """The ip(8) commands that make dev what the configuration says, from whatever it was.

    Each command is one step; a failing flush or delete of what is not there is expected
    (check=False), the rest must succeed.
    """
    # The loopback too: a name table may give a sandbox's own services on 127.0.0.x.
    cmds = [["ip", "link", "set", "dev", "lo", "up"]]
    cmds += [["ip", "link", "set", "dev", dev, "up"] + (["mtu", str(mtu)] if mtu else [])]
    cmds += [
        ["-", "ip", "-6", "route", "del", "default", "dev", dev],
        ["-", "ip", "-6", "route", "del", "fc00::/7", "dev", dev],
        ["-", "ip", "-6", "addr", "flush", "dev", dev, "scope", "global"],
        ["-", "ip", "-4", "route", "flush", "dev", dev],
        ["-", "ip", "-4", "addr", "flush", "dev", dev],
    ]
    if ipv6:
        dest = "fc00::/7" if ipv6_ula else "default"
        cmds += [
            ["ip", "-6", "addr", "add", f"{ipv6}/128", "dev", dev, "nodad"],
            ["ip", "-6", "route", "replace", dest, "via", IPV6_GATEWAY, "dev", dev]
            + (["mtu", str(mtu)] if mtu else []),
        ]
    if ipv4:
        cmds += [
            ["ip", "-4", "addr", "add", f"{ipv4}/32", "dev", dev],
            ["ip", "-4", "route", "replace", IPV4_GATEWAY, "dev", dev, "scope", "link"],
            ["ip", "-4", "route", "replace", "default", "via", IPV4_GATEWAY, "dev", dev, "onlink"],
        ]
    return cmds


def resolv_conf(resolvers: list[str]) -> str:
    return "".join(f"nameserver {r}\n" for r in resolvers) + (
        "options edns0\n" if resolvers else ""
    )


def write_in_place(path: str, text: str) -> None:
    """Rewrites a file keeping its inode: the containers bind-mount it."""
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)


def find_device(mac: str, net: str = "/sys/class/net") -> str:
    """The device with that MAC address, or the first ethernet device."""
    names = sorted(os.listdir(net))
    for name in names:
        try:
            with open(os.path.join(net, name, "address")) as f:
                address = f.read().strip()
            with open(os.path.join(net, name, "type")) as f:
                kind = f.read().strip()
        except OSError:
            continue
        if (mac and address == mac) or (not mac and kind == "1" and name != "lo"):
            return name
    raise FeosError(Code.FAILED_PRECONDITION, f"no network device {mac or '(ethernet)'}")


def batches(cmds: list[list[str]]) -> list[tuple[bool, list[str], list[str]]]:
    """ip(8) commands grouped into `ip -batch` scripts: (must succeed, options, lines), in order.

    Under TCG every process costs tens of milliseconds: a run of steps of one kind (expected to
    fail or not) and one family (-4, -6: a batch line cannot carry it) becomes one process.
    """
    out: list[tuple[bool, list[str], list[str]]] = []
    for cmd in cmds:
        must = cmd[0] != "-"
        argv = cmd if must else cmd[1:]
        if argv[0] != "ip":
            raise ValueError(f"not an ip(8) command: {argv}")
        options = [a for a in argv[1:2] if a in ("-4", "-6")]
        line = " ".join(argv[1 + len(options):])
        if out and out[-1][0] == must and out[-1][1] == options:
            out[-1][2].append(line)
        else:
            out.append((must, options, [line]))
    return out


async def run_steps(reaper: _proc.Reaper, cmds: list[list[str]]) -> None:
    for must, options, lines in batches(cmds):
        script = ("\n".join(lines) + "\n").encode()
        if not must:
            await _proc.run(reaper, ["ip", *options, "-force", "-batch", "-"], input=script)
            continue
        code, _out, err = await _proc.run(reaper, ["ip", *options, "-batch", "-"], input=script)
        if code != 0:
            raise FeosError(Code.INTERNAL, f"ip: {err.strip() or f'exit {code}'}")


# Drives and volumes ----------------------------------------------------------------------------


def drive_path(index: int, block: str = "/sys/block") -> str:
    """A drive of the pod by its index: serial "data" (0) or "vol<N>", else vda root, vdb data..."""
    serial = "data" if index == 0 else f"vol{index}"
    try:
        names = sorted(n for n in os.listdir(block) if n.startswith("vd"))
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(block, name, "serial")) as f:
                if f.read().strip() == serial:
                    return f"/dev/{name}"
        except OSError:
            continue
    by_place = "vd" + chr(ord("b") + index)
    if by_place in names:
        return f"/dev/{by_place}"
    raise FeosError(Code.NOT_FOUND, f"no drive {index} (serial {serial})")


def device_size(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def mounted_source(path: str) -> str | None:
    """What /proc/self/mounts says is mounted at path (the last mount there)."""
    found = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and fields[1] == path:
                    found = fields[0]
    except OSError:
        pass
    return found


async def mount_volume(
    reaper: _proc.Reaper, volumes_dir: str, vol: dict[str, Any], device: str
) -> None:
    target = os.path.join(volumes_dir, vol["name"])
    size = device_size(device)
    if vol["sizeBytes"] and size != vol["sizeBytes"]:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"drive {vol['drive']} ({device}) has {size} bytes,"
                        f" not {vol['sizeBytes']}")  # fmt: skip
    current = mounted_source(target)
    if current is not None:
        if os.path.realpath(current) == os.path.realpath(device):  # noqa: ASYNC240
            return
        raise FeosError(Code.FAILED_PRECONDITION, f"{target} holds {current} already")
    code, fstype, _ = await _proc.run(reaper, ["blkid", "-p", "-o", "value", "-s", "TYPE", device])
    if code not in (0, 2):
        raise FeosError(Code.INTERNAL, f"blkid {device} failed ({code})")
    if not fstype.strip():
        if not vol["format"]:
            raise FeosError(
                Code.FAILED_PRECONDITION,
                f"drive {vol['drive']} holds no filesystem and format is false",
            )
        await _check(
            reaper,
            ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1", device],
        )
    os.makedirs(target, exist_ok=True)
    await _check(reaper, ["mount", "-o", "noatime", device, target])


async def writable_dir(reaper: _proc.Reaper, path: str, run_dir: str) -> str:
    """A directory for mount points: path, with a tmpfs over it on a read-only root; where the
    root has no such directory at all, <run_dir>/volumes (said on the console)."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".feos-probe")
        os.mkdir(probe)
        os.rmdir(probe)
        return path
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
    if os.path.isdir(path):  # noqa: ASYNC240
        if mounted_source(path) is None:
            opts = "mode=0755,nosuid,nodev"
            await _check(reaper, ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path])
        return path
    fallback = os.path.join(run_dir, "volumes")
    print(f"feos-guest: the root has no {path}: volumes are mounted in {fallback}", flush=True)
    os.makedirs(fallback, exist_ok=True)
    return fallback


async def _check(reaper: _proc.Reaper, argv: list[str]) -> str:
    try:
        return await _proc.check(reaper, argv)
    except _proc.Failed as e:
        raise FeosError(Code.INTERNAL, str(e)) from None


# The data volume and memory --------------------------------------------------------------------


def freeze(path: str, thaw: bool) -> None:
    """FIFREEZE or FITHAW of the filesystem at path; one already so is found."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FITHAW if thaw else FIFREEZE, 0)
    except OSError as e:
        if (e.errno == errno.EBUSY and not thaw) or (e.errno == errno.EINVAL and thaw):
            return
        what = "FITHAW" if thaw else "FIFREEZE"
        code = Code.UNIMPLEMENTED if e.errno == errno.EOPNOTSUPP else Code.FAILED_PRECONDITION
        raise FeosError(code, f"{what} of {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def mem_free() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemFree:"):
                return int(line.split()[1]) * 1024
    return 0


def prepare_suspend() -> tuple[int, int]:
    """sync, drop the caches, compact memory (blocking): MemFree before and after."""
    before = mem_free()
    os.sync()
    for knob, value in (("drop_caches", "3"), ("compact_memory", "1")):
        try:
            with open(f"/proc/sys/vm/{knob}", "w") as f:
                f.write(value)
        except OSError as e:
            raise FeosError(Code.INTERNAL, f"/proc/sys/vm/{knob}: {e.strerror}") from None
    return before, mem_free()


def power_off(reboot: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    os.sync()
    libc.reboot(0x01234567 if reboot else 0x4321FEDC)  # RB_AUTOBOOT, RB_POWER_OFF
