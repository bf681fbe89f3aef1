"""A microVM's jail: which Firecracker runs it, its directory, its user, jail.json.

Theory of operation. <state>/vms/firecracker/<id>/ holds jail.json and root/, the chroot the
jailer puts Firecracker in (the jailer's own layout: <chroot base>/<exec file name>/<id>/root).
Everything a jail adds to the host that a deletion must undo is recorded in jail.json *before* it
is done, so that a create or a delete cut off by a crash or a restart of feosd is finished by the
next delete: the links into root/ (hard links, bind mounts, device nodes, with the owner a disk
had), the TAP devices, the cgroup directories and the user.

The chroot cannot follow a symlink out of itself, so a file goes in as a hard link where it is
on root/'s filesystem, as a read-only bind mount of the file where it is not (the guest's kernel
is 60 MB: a copy per microVM on a tmpfs /var/lib/feos would cost memory), and, for a block
device, as a device node of its own. A disk (data, volumeN) is chowned to the microVM's user,
which alone opens it; its owner before is recorded and given back on delete.

The microVM's user is a uid of its own from UID_BASE on, with the same gid; no /etc/passwd entry
is needed. Blocking work: run these functions on a worker thread (trio.to_thread.run_sync).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from feos.errors import Code, FeosError

FIRECRACKER_ROOT = Path("/usr/lib/feos/firecracker")
FIRECRACKER_DIR_ENV = "FEOS_FIRECRACKER_DIR"
UID_BASE = 900000
UID_COUNT = 65536
JAILER_LEFTOVERS = ("dev", "run", "firecracker", "firecracker.pid", "fc.sock", "v.sock")
LATE_MARKER = "late-snapshot"
NODE_LISTENS = "v.sock_10001"  # the node listens there for the guest's uplink (vsock port 10001)
_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)$")
_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,64}$")


# -- Firecracker versions ----------------------------------------------------------------------


@attrs.frozen
class FcInstall:
    """One installed Firecracker: its version ("v1.12.1") and its two binaries."""

    version: str
    firecracker: Path
    jailer: Path


def firecracker_root() -> Path:
    return Path(os.environ.get(FIRECRACKER_DIR_ENV) or FIRECRACKER_ROOT)


def _version_key(name: str) -> tuple[int, int, int]:
    m = _VERSION_RE.match(name)
    assert m is not None
    return int(m[1]), int(m[2]), int(m[3])


def installed(root: Path | None = None) -> list[FcInstall]:
    """The installed versions that have both binaries, oldest first."""
    root = root or firecracker_root()
    found = []
    with contextlib.suppress(OSError):
        for d in root.iterdir():
            fc, jailer = d / "firecracker", d / "jailer"
            if _VERSION_RE.match(d.name) and all(os.access(p, os.X_OK) for p in (fc, jailer)):
                found.append(FcInstall(d.name, fc, jailer))
    return sorted(found, key=lambda i: _version_key(i.version))


def _from_path() -> FcInstall | None:
    fc, jailer = shutil.which("firecracker"), shutil.which("jailer")
    if fc is None or jailer is None:
        return None
    done = subprocess.run([fc, "--version"], capture_output=True, text=True, timeout=10)
    m = re.search(r"v\d+\.\d+\.\d+", done.stdout)
    return FcInstall(m[0] if m else "unknown", Path(fc), Path(jailer))


def choose(root: Path | None = None) -> FcInstall:
    """What a boot runs: the newest installed version, else the ones in PATH."""
    versions = installed(root)
    if versions:
        return versions[-1]
    found = _from_path()
    if found is None:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"no Firecracker installed in {root or firecracker_root()} nor in PATH")
    return found


def find(version: str, root: Path | None = None) -> FcInstall:
    """What a restore runs: the snapshot's version, which must still be there."""
    for i in installed(root):
        if i.version == version:
            return i
    found = _from_path()
    if found is not None and found.version == version:
        return found
    raise FeosError(Code.FAILED_PRECONDITION,
                    f"the snapshot was written by Firecracker {version}, which is not installed "
                    f"any more")


# -- jail.json ---------------------------------------------------------------------------------


@attrs.define
class Link:
    """A file put into root/: how, from where, and the owner it had (a disk's, to give back)."""

    name: str
    source: str
    how: str  # "hardlink", "bind", "mknod"
    owner: tuple[int, int] | None = None


@attrs.define
class JailRecord:
    """jail.json: what a deletion undoes."""

    id: str
    uid: int
    version: str = ""
    firecracker: str = ""
    jailer: str = ""
    links: list[Link] = attrs.Factory(list)
    taps: list[str] = attrs.Factory(list)
    taps_made: list[str] = attrs.Factory(list)
    netns: str | None = None
    cgroups: list[str] = attrs.Factory(list)

    @property
    def gid(self) -> int:
        return self.uid

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JailRecord:
        links = [Link(name=x["name"], source=x["source"], how=x["how"],
                      owner=(int(x["owner"][0]), int(x["owner"][1])) if x.get("owner") else None)
                 for x in raw.get("links", [])]
        return cls(id=raw["id"], uid=int(raw["uid"]), version=raw.get("version", ""),
                   firecracker=raw.get("firecracker", ""), jailer=raw.get("jailer", ""),
                   links=links, taps=list(raw.get("taps", [])),
                   taps_made=list(raw.get("taps_made", [])), netns=raw.get("netns"),
                   cgroups=list(raw.get("cgroups", [])))


def write_json_file(path: Path, data: Any) -> None:
    """Written whole and synced: a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


@attrs.frozen
class Jail:
    """The paths of one microVM's jail under a state directory (/var/lib/feos)."""

    state: Path
    id: str

    def __attrs_post_init__(self) -> None:
        if not _ID_RE.match(self.id):
            raise FeosError(Code.INVALID_ARGUMENT, f"microVM id {self.id!r}: not a jailer id")

    @property
    def chroot_base(self) -> Path:
        return self.state / "vms"

    @property
    def dir(self) -> Path:
        return self.chroot_base / "firecracker" / self.id

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def record_path(self) -> Path:
        return self.dir / "jail.json"

    def path(self, name: str) -> Path:
        return self.root / name

    def read(self) -> JailRecord | None:
        try:
            return JailRecord.from_json(json.loads(self.record_path.read_text()))
        except FileNotFoundError:
            return None

    def write(self, record: JailRecord) -> None:
        write_json_file(self.record_path, record.to_json())


# -- the microVM's user ------------------------------------------------------------------------


@contextlib.contextmanager
def _uid_lock(base: Path) -> Iterator[None]:
    base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base / ".uid.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def used_uids(base: Path) -> set[int]:
    used = set()
    for record in base.glob("*/jail.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            used.add(int(json.loads(record.read_text())["uid"]))
    return used


def lowest_free(used: set[int]) -> int:
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        if uid not in used:
            return uid
    raise FeosError(Code.RESOURCE_EXHAUSTED, f"all {UID_COUNT} microVM users are taken")


def make(jail: Jail) -> JailRecord:
    """The jail's directory and jail.json with a user of its own; an existing jail is kept."""
    base = jail.dir.parent
    with _uid_lock(base):
        record = jail.read()
        if record is not None:
            return record
        jail.root.mkdir(parents=True, exist_ok=True)
        record = JailRecord(id=jail.id, uid=lowest_free(used_uids(base)))
        jail.write(record)
    return record


# -- what goes into root/ ----------------------------------------------------------------------


def _same_fs(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def link_in(jail: Jail, record: JailRecord, name: str, source: Path, *, disk: bool) -> None:
    """Put `source` into root/ as `name` (see the module's comment for how); recorded first."""
    target = jail.path(name)
    unlink_one(jail, record, name)
    st = os.stat(source)
    if stat.S_ISBLK(st.st_mode):
        how = "mknod"
    elif stat.S_ISREG(st.st_mode):
        how = "hardlink" if _same_fs(source, jail.root) else "bind"
    else:
        raise FeosError(Code.INVALID_ARGUMENT, f"{source}: neither a file nor a block device")
    owner = (st.st_uid, st.st_gid) if disk and how != "mknod" else None
    record.links.append(Link(name=name, source=str(source), how=how, owner=owner))
    jail.write(record)
    if how == "mknod":
        os.mknod(target, stat.S_IFBLK | 0o600, st.st_rdev)
    elif how == "hardlink":
        os.link(source, target)
    else:
        target.touch(mode=0o600)
        flags = [] if disk else ["-o", "ro"]
        _run(["mount", "--bind", *flags, str(source), str(target)])
        if not disk:  # a read-only bind takes a remount on older kernels
            _run(["mount", "-o", "remount,bind,ro", str(target)], check=False)
    if disk:
        os.chown(target, record.uid, record.gid)


def unlink_one(jail: Jail, record: JailRecord, name: str) -> None:
    """Undo one link of jail.json (and drop it from the record); nothing if there is none."""
    for link in [x for x in record.links if x.name == name]:
        target = jail.path(name)
        if link.owner is not None and target.exists():
            # a hard link shares the disk's inode; a bind reaches the file it binds (a FUSE
            # export of diskd's takes the chown), so the owner goes back before the unmount
            os.chown(target, *link.owner)
        if link.how == "bind":
            _run(["umount", str(target)], check=False)
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        record.links.remove(link)
        jail.write(record)


def _run(argv: list[str], *, check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise FeosError(Code.INTERNAL, f"{' '.join(argv)}: {done.stderr.strip()}")


def own_file(jail: Jail, record: JailRecord, name: str, *, fifo: bool = False) -> Path:
    """A file of the microVM's own in root/ (vmm.log, console.in, snapshot/), owned by its user."""
    target = jail.path(name)
    if fifo:
        with contextlib.suppress(FileExistsError):
            os.mkfifo(target, 0o600)
    elif name.endswith("/"):
        target.mkdir(mode=0o700, exist_ok=True)
    else:
        target.touch(mode=0o600)
    os.chown(target, record.uid, record.gid)
    return target


def clear_jailer_leftovers(jail: Jail) -> None:
    """What the jailer (and Firecracker) made at the last start, which a new start makes again:
    the jailer refuses to start over its own dev/ nodes."""
    for name in JAILER_LEFTOVERS:
        p = jail.path(name)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    for p in jail.root.glob("v.sock_*"):
        if p.name != NODE_LISTENS:  # the node's listener for the guest's uplink stays
            p.unlink()


def jailer_argv(jail: Jail, record: JailRecord, *, cgroup_args: list[str] | None,
                metadata: bool, netns: str | None = None) -> list[str]:
    """The jailer's command line. No --daemonize: it would send the serial console to /dev/null;
    feosd starts it in a session of its own instead. Firecracker's paths are the jail's."""
    argv = [record.jailer, "--id", jail.id, "--exec-file", record.firecracker,
            "--uid", str(record.uid), "--gid", str(record.gid),
            "--chroot-base-dir", str(jail.chroot_base)]
    if netns:
        argv += ["--netns", netns]
    argv += cgroup_args if cgroup_args is not None else ["--cgroup-version", "1"]
    argv += ["--", "--api-sock", "fc.sock", "--log-path", "vmm.log", "--level", "Info"]
    if metadata:
        argv += ["--metadata", "metadata.json"]
    return argv


# -- TAP devices -------------------------------------------------------------------------------


def _ip(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise FeosError(Code.INTERNAL, f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def ensure_tap(jail: Jail, record: JailRecord, tap: str, netns: str | None = None) -> None:
    """The TAP device, owned by the microVM's user: made if it is not there (and recorded, so
    that a delete removes it), else given to the user."""
    if tap not in record.taps:
        record.taps.append(tap)
        record.netns = netns
        jail.write(record)
    exists = _ip(netns, "link", "show", "dev", tap, check=False).returncode == 0
    if not exists:
        if tap not in record.taps_made:
            record.taps_made.append(tap)
            jail.write(record)
        _ip(netns, "tuntap", "add", "dev", tap, "mode", "tap", "user", str(record.uid),
            "group", str(record.gid), "vnet_hdr")
        return
    owner = Path(f"/sys/class/net/{tap}/owner")
    if netns is None and owner.exists() and owner.read_text().strip() != str(record.uid):
        _set_tap_owner(tap, record.uid, record.gid)


_TUNSETIFF, _TUNSETOWNER, _TUNSETGROUP = 0x400454CA, 0x400454CC, 0x400454CE
_IFF_TAP, _IFF_NO_PI, _IFF_MULTI_QUEUE, _IFF_VNET_HDR = 0x0002, 0x1000, 0x0100, 0x4000


def _set_tap_owner(tap: str, uid: int, gid: int) -> None:
    import struct

    flags = _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR
    if "multi_queue" in Path(f"/sys/class/net/{tap}/tun_flags").read_text():
        flags |= _IFF_MULTI_QUEUE
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", tap.encode(), flags))
        fcntl.ioctl(fd, _TUNSETOWNER, uid)
        fcntl.ioctl(fd, _TUNSETGROUP, gid)
    except OSError as e:
        raise FeosError(Code.INTERNAL, f"giving TAP {tap} to uid {uid}: {e.strerror}") from e
    finally:
        os.close(fd)


def remove_taps(record: JailRecord) -> None:
    """The TAPs the jail made itself. A TAP it was given (the network layer's) is the network's
    to remove with the pod: a microVM deleted to boot anew (a stopped pod's, or one moved to
    another VMM) keeps the pod's TAP."""
    for tap in record.taps_made:
        done = _ip(record.netns, "link", "delete", "dev", tap, check=False)
        if done.returncode != 0 and "Cannot find device" not in done.stderr \
                and "does not exist" not in done.stderr:
            raise FeosError(Code.INTERNAL, f"deleting TAP {tap}: {done.stderr.strip()}")


# -- undoing it all ----------------------------------------------------------------------------


def undo(jail: Jail) -> None:
    """Undo what jail.json records but the cgroups (whose process must be gone first, see
    _cgroup.remove_dirs) and remove the directory. Idempotent: a delete cut off is done again."""
    record = jail.read()
    if record is not None:
        for link in list(record.links):
            unlink_one(jail, record, link.name)
        remove_taps(record)
    # bind mounts that a crash left unrecorded would make rmtree fail with EBUSY
    for p in jail.root.glob("*") if jail.root.exists() else ():
        if os.path.ismount(p):
            _run(["umount", str(p)], check=False)
    try:
        shutil.rmtree(jail.dir)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise FeosError(Code.INTERNAL, f"removing {jail.dir}: {e}") from e
