"""The machine's setup as PID 1: the root off the initramfs, the filesystems, the modules, the
console's log (host-init's and its programs'), the resolver's sockets, SR-IOV, sysctls, power.
The one place here that calls libc (mount, reboot) and raises OSError for it. It imports little:
it runs before the loop's modules are imported (feos/hostinit/_main.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

log = logging.getLogger("feos.hostinit")

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC = 2, 4, 8, 4096, 8192, 16384
RB_AUTOBOOT, RB_POWER_OFF, RB_DISABLE_CAD = 0x01234567, 0x4321FEDC, 0
NEW_ROOT = "/.root"
# Set by a sandbox run on a development host (namespaces and a chroot of the image: the node's
# own code end to end without a VM): the host's clock and cgroup2 mount options are not ours.
SANDBOX = os.environ.get("FEOS_HOSTINIT_SANDBOX") == "1"
# What the node needs beyond what its devices ask for (coldplug loads those by their modalias).
NODE_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "virtio_rng",
    "virtio_console",
    "tun",
    "vhost_net",
    "vhost_vsock",
    "vsock",
    "kvm_intel",
    "kvm_amd",
    "nf_tables",
    "nft_ct",
    "nft_nat",
    "nft_masq",
    "nft_chain_nat",
    "nft_fib_inet",
    "nft_reject_inet",
    "nf_conntrack",
    "nf_nat",
    "veth",
    "overlay",
    "erofs",
    "ext4",
    "fuse",
    "loop",
    "wireguard",
)

IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {fstype or 'bind/move'} {source} on {target}")


def reboot(cmd: int) -> None:
    _check(_libc.reboot(ctypes.c_int(cmd)), "reboot")


def _mounted(target: str) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    return any(line.split()[4] == target for line in text.splitlines())


def move_root_off_initramfs() -> bool:
    """Make / a mount of its own, as switch_root does, without copying: a bind of the initramfs
    moved onto /. The kernel's first mount (rootfs) refuses pivot_root, which the jailer and crun
    need; a mount below it does not. False when / is already such a mount (a second start)."""
    if Path("/proc/self").exists():  # / is not the bare initramfs: /proc is mounted already
        return False
    os.makedirs(NEW_ROOT, exist_ok=True)
    mount("/", NEW_ROOT, None, MS_BIND)
    os.chdir(NEW_ROOT)
    mount(".", "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    return True


def mount_filesystems() -> None:
    """proc, sys, dev, dev/pts, run, tmp, /var/lib/feos, cgroup2: each once, made if missing."""
    table = (
        ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
        ("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
        ("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755"),
        ("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=620,ptmxmode=666"),
        ("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
        ("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
        ("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
        ("tmpfs", "/var/lib/feos", "tmpfs", 0, "mode=0755"),
        ("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "nsdelegate"),
        ("bpf", "/sys/fs/bpf", "bpf", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0700"),
    )
    for source, target, fstype, flags, data in table:
        if SANDBOX and fstype == "cgroup2":
            continue
        if target != "/proc" and _mounted(target):
            continue
        os.makedirs(target, exist_ok=True)
        try:
            mount(source, target, fstype, flags, data)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.error("%s", exc)
    for link, to in (("/dev/fd", "/proc/self/fd"), ("/dev/ptmx", "pts/ptmx")):
        if not os.path.lexists(link):
            os.symlink(to, link)


def cgroup_controllers() -> str:
    try:
        return Path("/sys/fs/cgroup/cgroup.controllers").read_text().strip()
    except OSError as exc:
        return f"none ({exc.strerror})"


def write(path: str, value: str) -> bool:
    try:
        Path(path).write_text(value)
        return True
    except OSError as exc:
        log.warning("cannot write %s to %s: %s", value.strip(), path, exc.strerror)
        return False


def _modaliases() -> set[str]:
    found = set()
    for path in Path("/sys/devices").rglob("modalias"):
        try:
            alias = path.read_text().strip()
        except OSError:
            continue
        if alias:
            found.add(alias)
    return found


def _modprobe(names: list[str]) -> None:
    if names:
        subprocess.run(["modprobe", "-a", "-q", "-b", *names], check=False)


Loading = subprocess.Popen[bytes]


def start_modules() -> Loading:
    """modprobe of the node's own modules, started: wait_modules waits for it."""
    return subprocess.Popen(["modprobe", "-a", "-q", "-b", *NODE_MODULES])


def wait_modules(loading: Loading | None) -> None:
    """The node's own modules loaded: start_modules's, or here if that could not start."""
    if loading is None:
        _modprobe(list(NODE_MODULES))
    else:
        loading.wait()


def coldplug() -> list[str]:
    """What the devices ask for, in rounds while new devices appear (virtio_mmio's need it
    loaded first); every module loaded, for the log."""
    seen: set[str] = set()
    for _ in range(4):
        new = sorted(_modaliases() - seen)
        if not new:
            break
        seen.update(new)
        _modprobe(new)
    try:
        return sorted(p.name for p in Path("/sys/module").iterdir() if (p / "initstate").exists())
    except OSError:
        return []


def bind_resolver_sockets(
    address: str = "169.254.0.53", port: int = 53
) -> tuple[socket.socket, socket.socket]:
    """The pods' resolver's UDP and listening TCP sockets, bound before the node holds the
    address (IP_FREEBIND), handed to every feosd. feos.net's bind_dns_sockets does the same,
    but importing feos.net costs PID 1 a second on the host, twenty under TCG."""
    socks = []
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        if kind == socket.SOCK_STREAM:
            s.listen(1024)
        socks.append(s)
    return socks[0], socks[1]


def has_link(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def configure_sriov(ifname: str) -> str:
    """All the VFs the uplink's device offers; what was done, for the log."""
    device = Path(f"/sys/class/net/{ifname}/device")
    total = device / "sriov_totalvfs"
    if not total.exists():
        return f"{ifname} offers no SR-IOV (its device has no sriov_totalvfs)"
    want = total.read_text().strip()
    if (device / "sriov_numvfs").read_text().strip() == want:
        return f"{ifname}: {want} SR-IOV VFs already"
    if want != "0" and not write(str(device / "sriov_numvfs"), want):
        return f"{ifname}: the {want} SR-IOV VFs could not be made"
    return f"{ifname}: {want} SR-IOV VFs"


def mac_of(ifname: str) -> bytes:
    return bytes.fromhex(
        Path(f"/sys/class/net/{ifname}/address").read_text().strip().replace(":", "")
    )


class KmsgHandler(logging.Handler):
    """Records to /dev/kmsg, one write each, with their syslog level and a newline: the console
    shows them with the kernel's time, and dmesg keeps them."""

    LEVELS: ClassVar[dict[int, int]] = {
        logging.DEBUG: 7,
        logging.INFO: 6,
        logging.WARNING: 4,
        logging.ERROR: 3,
    }

    def __init__(self) -> None:
        super().__init__()
        self._fd = os.open("/dev/kmsg", os.O_WRONLY | os.O_CLOEXEC)

    def emit(self, record: logging.LogRecord) -> None:
        level = self.LEVELS.get(record.levelno, 3)
        text = self.format(record).replace("\n", " | ")
        try:
            # The newline ends the record: one without is held open for a continuation, and
            # the console prints it only once the next record comes (or never, at the end).
            line = f"<{level}>feos-host-init: {text}".encode()[:1000]
            os.write(self._fd, line + b"\n")
        except OSError:
            self.handleError(record)


def log_to_kmsg() -> None:
    handler: logging.Handler
    if SANDBOX:  # the development host's kernel log is not ours either
        handler = logging.StreamHandler()
    else:
        write("/proc/sys/kernel/printk_devkmsg", "on\n")  # lifts the ten records in 5 seconds
        handler = KmsgHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("pyroute2").setLevel(logging.WARNING)


def program_output() -> Callable[[bytes], None]:
    """Where the lines of diskd's and feosd's output go, as records of _plan.program_records:
    /dev/kmsg, beside host-init's own (a sandbox's: stderr, without the level)."""
    if SANDBOX:
        return lambda record: _write_record(2, record.partition(b">")[2])
    fd = os.open("/dev/kmsg", os.O_WRONLY | os.O_CLOEXEC)
    return lambda record: _write_record(fd, record)


def _write_record(fd: int, record: bytes) -> None:
    os.write(fd, record)  # one write, one record: /dev/kmsg takes it whole or refuses it
