"""The pod's identity in its guest: what a guest restored from a template's snapshot must take on
before anything runs in it (docs/templates.md), and a cold boot takes on the same way.

A template's guest booted once for every pod restored from it: its hostname, its machine ID,
its network device's MAC address and its kernel's random pool are the template's until the node
says whose guest it is now. `assume` (the agent's) sets them all and reseeds the pool.

The random pool: the node sends fresh bytes of its own, and the agent mixes in what it measures
itself (clock readings), credits them (RNDADDENTROPY) and has the kernel reseed its generator at
once (RNDRESEEDCRNG): every read of /dev/urandom or getrandom(2) after the answer differs from
the template's and from any other pod's. QEMU 7.2 takes `-device vmgenid` on microvm but only the
pc and q35 machines' ACPI tables describe it (microvm's DSDT has no VGEN device, and no firmware
writes its address), so the guest's kernel cannot find one: this is the one reseed there is.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

from feos.errors import Code, FeosError

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
MACHINE_ID = "machine-id"  # in the agent's run directory; containers see it as /etc/machine-id


def entropy_of(seed: bytes) -> bytes:
    """The node's bytes and the agent's own clock readings, as a rand_pool_info: credited at
    the node's bytes only (the clock is mixed in, not counted)."""
    own = b"".join(struct.pack("=QQ", time.perf_counter_ns(), time.time_ns()) for _ in range(8))
    data = seed + own
    return struct.pack("=ii", 8 * len(seed), len(data)) + data


def reseed(seed: bytes, device: str = "/dev/urandom") -> None:
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise FeosError(Code.INTERNAL, f"{device}: {e.strerror}") from None
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, entropy_of(seed))
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError as e:
        raise FeosError(Code.INTERNAL, f"the random pool was not reseeded: {e.strerror}") from None
    finally:
        os.close(fd)


def check_machine_id(machine_id: str) -> str:
    if len(machine_id) != 32 or any(c not in "0123456789abcdef" for c in machine_id):
        raise FeosError(Code.INVALID_ARGUMENT, "machineId: must be 32 lowercase hex digits")
    return machine_id


def write_machine_id(run_dir: str, machine_id: str) -> str:
    path = os.path.join(run_dir, MACHINE_ID)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(check_machine_id(machine_id) + "\n")
    os.replace(tmp, path)
    return path


def set_hostname(name: str) -> None:
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-." for c in name):
        raise FeosError(Code.INVALID_ARGUMENT, "hostname: 1 to 64 letters, digits, - or .")
    try:
        socket.sethostname(name)
    except OSError as e:
        raise FeosError(Code.INTERNAL, f"sethostname: {e.strerror}") from None


def set_mac(mac: str, net: str = "/sys/class/net") -> str:
    """The first ethernet device given that address, if it has another (a restored guest's has
    the template's); its name, "" without one."""
    from . import _netlink as nl
    from ._system import Step, apply_plan, find_device

    if not mac:
        return ""
    try:
        find_device(mac, net)
        return ""  # it has it already
    except FeosError:
        pass
    try:
        dev = find_device("", net)
    except FeosError:
        return ""  # a pod without a network has no device to name
    raw = bytes.fromhex(mac.replace(":", ""))
    if len(raw) != 6:
        raise FeosError(Code.INVALID_ARGUMENT, "mac: six bytes, as 06:00:12:34:56:78")
    step = Step(f"set {dev}'s address to {mac}", nl.RTM_NEWLINK, 0,
                nl.link_address(socket.if_nametoindex(dev), raw))
    try:
        with nl.Socket() as sock:
            apply_plan(sock, [step])
    except (OSError, nl.Malformed) as e:
        raise FeosError(Code.INTERNAL, f"netlink: {type(e).__name__}: {e}") from None
    return dev
