"""The guest's own machine: clock, network, volumes, the data volume's freeze, memory, power.

The pure parts (the rtnetlink requests of a network configuration, a drive's name) are functions
of their inputs; the rest runs commands through the Reaper, or sends netlink messages, or does
one syscall.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from feos.errors import Code, FeosError

from . import _netlink as nl
from . import _proc

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    NamedTuple = nl.Record  # typing.NamedTuple's class syntax, without typing

FIFREEZE = 0xC0045877
FITHAW = 0xC0045878
SLEW_LIMIT_NS = 500_000_000  # adjtime's own bound: larger offsets are stepped
ADJ_OFFSET_SINGLESHOT = 0x8001
IPV6_GATEWAY = "fe80::1"
IPV4_GATEWAY = "169.254.0.1"
ULA_NET = bytes([0xFC]) + bytes(15)  # fc00::/7


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


class Step(NamedTuple):
    """One rtnetlink request of a configuration; missing_ok: a delete of what is not there."""

    name: str
    kind: int
    flags: int
    payload: bytes
    missing_ok: bool = False


class Flush(NamedTuple):
    """A dump of the family's addresses (RTM_GETADDR) or routes (RTM_GETROUTE), then a delete
    of each that is the device's (addresses: of global scope only if global_only; routes: of
    the main table, as `ip route flush dev` does)."""

    name: str
    dump: int
    family: int
    ifindex: int
    global_only: bool = False


# A delete of a route, an address that is not there; or of an IPv6 route on a kernel without
# IPv6 (EOPNOTSUPP), where ip(8)'s delete failed too and was ignored.
MISSING = (errno.ESRCH, errno.EADDRNOTAVAIL, errno.EOPNOTSUPP)
ADD, REPLACE = nl.NLM_F_CREATE | nl.NLM_F_EXCL, nl.NLM_F_CREATE | nl.NLM_F_REPLACE
V6, V4 = socket.AF_INET6, socket.AF_INET


def network_plan(dev: str, lo: int, index: int, ipv6: str, ipv6_ula: bool, ipv4: str,
                 mtu: int) -> list[Step | Flush]:  # fmt: skip
    """The requests that make device index what the configuration says, from whatever it was.

    What `ip` did before: lo up (a name table may give a sandbox's own services on 127.0.0.x),
    the device up with its MTU; the IPv6 default and fc00::/7 routes deleted, the global IPv6
    addresses, the IPv4 routes and addresses flushed; then the new addresses and routes.
    """
    plan: list[Step | Flush] = [
        Step("link up lo", nl.RTM_NEWLINK, 0, nl.link_up(lo)),
        Step(f"link up {dev}" + (f" mtu {mtu}" if mtu else ""), nl.RTM_NEWLINK, 0,
             nl.link_up(index, mtu)),
        Step("delete the IPv6 default route", nl.RTM_DELROUTE, 0,
             nl.route_msg(V6, index, b"", 0, delete=True), missing_ok=True),
        Step("delete the fc00::/7 route", nl.RTM_DELROUTE, 0,
             nl.route_msg(V6, index, ULA_NET, 7, delete=True), missing_ok=True),
        Flush("flush the global IPv6 addresses", nl.RTM_GETADDR, V6, index, global_only=True),
        Flush("flush the IPv4 routes", nl.RTM_GETROUTE, V4, index),
        Flush("flush the IPv4 addresses", nl.RTM_GETADDR, V4, index),
    ]  # fmt: skip
    if ipv6:
        addr, gw = socket.inet_pton(V6, ipv6), socket.inet_pton(V6, IPV6_GATEWAY)
        dst, dst_len = (ULA_NET, 7) if ipv6_ula else (b"", 0)
        plan += [
            Step(f"add {ipv6}/128", nl.RTM_NEWADDR, ADD,
                 nl.addr_msg(V6, index, addr, 128, nl.IFA_F_NODAD)),
            Step(f"route {'fc00::/7' if ipv6_ula else 'default'} via {IPV6_GATEWAY}",
                 nl.RTM_NEWROUTE, REPLACE,
                 nl.route_msg(V6, index, dst, dst_len, gateway=gw, mtu=mtu)),
        ]  # fmt: skip
    if ipv4:
        addr, gw = socket.inet_pton(V4, ipv4), socket.inet_pton(V4, IPV4_GATEWAY)
        plan += [
            Step(f"add {ipv4}/32", nl.RTM_NEWADDR, ADD, nl.addr_msg(V4, index, addr, 32)),
            Step(f"route {IPV4_GATEWAY} scope link", nl.RTM_NEWROUTE, REPLACE,
                 nl.route_msg(V4, index, gw, 32, scope=nl.RT_SCOPE_LINK)),
            Step(f"route default via {IPV4_GATEWAY} onlink", nl.RTM_NEWROUTE, REPLACE,
                 nl.route_msg(V4, index, b"", 0, gateway=gw, flags=nl.RTNH_F_ONLINK)),
        ]  # fmt: skip
    return plan


def flush_deletes(flush: Flush, items: list[nl.Msg]) -> list[tuple[int, bytes]]:
    """The deletes of a flush: each matching dumped message sent back as it came, as ip(8)'s
    flush does (the kernel matches a delete on what the dump said)."""
    out = []
    for msg in items:
        if flush.dump == nl.RTM_GETADDR and msg.type == nl.RTM_NEWADDR:
            a = nl.read_addr(msg.payload)
            if (a.family, a.ifindex) == (flush.family, flush.ifindex) and (
                not flush.global_only or a.scope == nl.RT_SCOPE_UNIVERSE
            ):
                out.append((nl.RTM_DELADDR, msg.payload))
        elif flush.dump == nl.RTM_GETROUTE and msg.type == nl.RTM_NEWROUTE:
            r = nl.read_route(msg.payload)
            if (r.family, r.oif, r.table) == (flush.family, flush.ifindex, nl.RT_TABLE_MAIN) and (
                not r.flags & nl.RTM_F_CLONED
            ):
                out.append((nl.RTM_DELROUTE, msg.payload))
    return out


def _ask(sock: nl.Socket, name: str, kind: int, flags: int, payload: bytes,
         missing_ok: bool) -> nl.Reply:  # fmt: skip
    reply = sock.ask(kind, flags, payload)
    if reply.error and not (missing_ok and reply.error in MISSING):
        raise FeosError(Code.INTERNAL, nl.describe(name, reply.error, reply.text))
    return reply


def apply_plan(sock: nl.Socket, plan: list[Step | Flush]) -> None:
    for step in plan:
        if isinstance(step, Step):
            _ask(sock, step.name, step.kind, step.flags, step.payload, step.missing_ok)
            continue
        dump = nl.addr_dump if step.dump == nl.RTM_GETADDR else nl.route_dump
        for _round in range(3):  # again only if the kernel says the dump was interrupted
            reply = _ask(sock, step.name, step.dump, nl.NLM_F_DUMP, dump(step.family), False)
            for kind, payload in flush_deletes(step, reply.items):
                _ask(sock, step.name, kind, 0, payload, True)
            if not reply.interrupted:
                break


def configure_network(dev: str, ipv6: str, ipv6_ula: bool, ipv4: str, mtu: int) -> None:
    """Makes dev what the configuration says over rtnetlink (blocking, microseconds a step)."""
    try:
        lo, index = socket.if_nametoindex("lo"), socket.if_nametoindex(dev)
    except OSError:
        raise FeosError(Code.FAILED_PRECONDITION, f"no network device {dev}") from None
    plan = network_plan(dev, lo, index, ipv6, ipv6_ula, ipv4, mtu)
    try:
        with nl.Socket() as sock:
            apply_plan(sock, plan)
    except (OSError, nl.Malformed) as e:
        raise FeosError(Code.INTERNAL, f"netlink: {type(e).__name__}: {e}") from None


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


ZERO_MARGIN = 32 << 20  # free memory a zeroing pass leaves alone (the kernel's reserves)
ZERO_CHUNK = 8 << 20


def prepare_suspend(zero_free: bool = False) -> tuple[int, int]:
    """sync, drop the caches, compact memory (blocking): MemFree before and after; with
    zero_free, then a zeroing pass over the free memory (zero_free_memory)."""
    before = mem_free()
    os.sync()
    for knob, value in (("drop_caches", "3"), ("compact_memory", "1")):
        try:
            with open(f"/proc/sys/vm/{knob}", "w") as f:
                f.write(value)
        except OSError as e:
            raise FeosError(Code.INTERNAL, f"/proc/sys/vm/{knob}: {e.strerror}") from None
    if zero_free:
        zero_free_memory()
    return before, mem_free()


def zero_free_memory(margin: int = ZERO_MARGIN) -> int:
    """Free pages made zero pages: anonymous memory faulted in a chunk at a time (the kernel
    clears each page it hands out; the byte written is a zero) until MemFree is down to the
    margin, then all unmapped. Pages the dropped page cache held keep their data when freed, so
    a snapshot would carry them; zeroed, QEMU sends them as zero pages. The bytes zeroed."""
    import mmap

    chunks: list[mmap.mmap] = []
    done = 0
    try:
        while mem_free() - ZERO_CHUNK > margin:
            chunk = mmap.mmap(-1, ZERO_CHUNK, flags=mmap.MAP_PRIVATE)  # anonymous
            chunk[::mmap.PAGESIZE] = bytes(ZERO_CHUNK // mmap.PAGESIZE)
            chunks.append(chunk)
            done += ZERO_CHUNK
    except (OSError, MemoryError):
        pass  # what could be had is zeroed
    finally:
        for chunk in chunks:
            chunk.close()
    return done


def power_off(reboot: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    os.sync()
    libc.reboot(0x01234567 if reboot else 0x4321FEDC)  # RB_AUTOBOOT, RB_POWER_OFF
