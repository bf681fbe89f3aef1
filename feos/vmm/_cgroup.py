"""The microVMs' cgroups: vms/<id> below the cgroup feosd is given, a CPU weight per vCPU, no caps.

Two layouts, one interface (node.md, "Jail, user and cgroup"):

- cgroup v2, where the unified hierarchy has the cpu and memory controllers. A cgroup whose
  children use controllers may hold no process, so feosd first moves out of its cgroup into the
  leaf feosd/ of it, unless its cgroup is the real root of the hierarchy (the one cgroup without a
  cgroup.type file), which may hold processes beside such children. Then cpu and memory are
  enabled in that cgroup and in vms/, never above, and each microVM's cgroup gets cpu.weight 100
  per vCPU.
- cgroup v1 (hybrid hosts such as the ones this is built on): the cpu, memory and pids
  hierarchies each get vms/<id> below feosd's cgroup in that hierarchy. v1 has no rule against
  processes beside children, so feosd stays where it is, but in a container. cpu.shares is the
  weight: v2's default weight 100 is v1's default 1024 shares, so a vCPU is 1024 shares.

In a container (a cgroup namespace of its own, as a Kubernetes pod's container has: node.md, "On
Kubernetes") the cgroup feosd is given is the container's, which /proc shows as /: on either
version feosd moves into feosd/ of it and the microVMs go into vms/<id> beside it, so that they
end with the container. The kernel's first cgroup namespace has a fixed inode number, which
tells feosd where it runs.

Everything here is a short blocking file operation on cgroupfs; the async callers run it with
trio.to_thread.run_sync. Which files to write is decided by pure functions (the plans below),
tested without a cgroup filesystem.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from feos.errors import Code, FeosError

V1_HIERARCHIES = ("cpu", "memory", "pids")
V2_CONTROLLERS = ("cpu", "memory")
WEIGHT_PER_VCPU = 100
SHARES_PER_VCPU = 1024
_WEIGHT_MAX = 10000
_SHARES_MAX = 262144


def weight_of(vcpus: int) -> int:
    """cgroup v2 cpu.weight of a microVM: 100 a vCPU, within the kernel's 1..10000."""
    return max(1, min(_WEIGHT_MAX, WEIGHT_PER_VCPU * vcpus))


def shares_of(vcpus: int) -> int:
    """cgroup v1 cpu.shares of a microVM: weight 100 is 1024 shares, so 1024 a vCPU."""
    return max(2, min(_SHARES_MAX, SHARES_PER_VCPU * vcpus))


# -- what the kernel tells: /proc/self/cgroup and /proc/self/mountinfo --------------------------


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """The path of a process's cgroup by hierarchy: a v1 controller's name, or "" for cgroup v2.

    Lines are "<id>:<controllers>:<path>"; a v1 line names one or more controllers joined by
    commas, each of which gets the path. Lines that do not parse are skipped: the caller finds
    what it needs or says that it is missing.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            out[""] = path
            continue
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


@attrs.frozen
class CgroupMount:
    """A mounted cgroup hierarchy: where, which cgroup is its root here, its v1 controllers."""

    mount_point: Path
    root: str
    version: int
    controllers: frozenset[str]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup mounts of a /proc/<pid>/mountinfo."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        version = 2 if tail[0] == "cgroup2" else 1
        options = set(tail[2].split(",")) if version == 1 else set()
        controllers = frozenset(options & {*V1_HIERARCHIES, "cpuacct", "cpuset", "blkio"})
        mounts.append(CgroupMount(Path(_unescape(fields[4])), _unescape(fields[3]), version,
                                  controllers))
    return mounts


def _below(mount: CgroupMount, path: str) -> Path:
    """The directory of cgroup `path` (as /proc shows it) inside a mount of its hierarchy."""
    rel = os.path.relpath(path, mount.root) if mount.root != "/" else path.lstrip("/")
    if rel.startswith(".."):
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"cgroup {path} is outside the mount {mount.mount_point} ({mount.root})")
    return mount.mount_point / rel if rel not in ("", ".") else mount.mount_point


# -- where feosd runs ---------------------------------------------------------------------------

# The inode number of the kernel's initial cgroup namespace (PROC_CGROUP_INIT_INO): fixed, so a
# process in any other namespace sees another number in /proc/self/ns/cgroup.
INITIAL_CGROUP_NAMESPACE = 0xEFFFFFFB


def own_cgroup_namespace(proc: Path = Path("/proc/self")) -> bool:
    """Whether the process runs in a cgroup namespace of its own (a container): False where
    the kernel has none (no ns/cgroup), as on a kernel without cgroup namespaces."""
    try:
        return os.stat(proc / "ns" / "cgroup").st_ino != INITIAL_CGROUP_NAMESPACE
    except FileNotFoundError:
        return False


# -- the layouts -------------------------------------------------------------------------------


@attrs.frozen
class V2Layout:
    """cgroup v2: the cgroup that vms/ goes below, and where feosd moves (None: it stays)."""

    base: Path
    leaf: Path | None
    controllers: tuple[str, ...] = V2_CONTROLLERS

    @property
    def vms(self) -> Path:
        return self.base / "vms"


@attrs.frozen
class V1Layout:
    """cgroup v1: the cgroup that vms/ goes below in each hierarchy there is, and where feosd
    moves in each (none: it stays)."""

    bases: Mapping[str, Path]
    leaves: Mapping[str, Path] = attrs.field(factory=dict)

    def vms(self, hierarchy: str) -> Path:
        return self.bases[hierarchy] / "vms"


Layout = V1Layout | V2Layout


def is_real_root(cgroup_dir: Path) -> bool:
    """The real root of a v2 hierarchy is the one cgroup without cgroup.type; a cgroup
    namespace's root, which /proc shows as / as well, has one."""
    return not (cgroup_dir / "cgroup.type").exists()


def v2_layout_for(own: Path, *, given: Path | None = None,
                  controllers: tuple[str, ...] = V2_CONTROLLERS,
                  container: bool = False) -> V2Layout:
    """The v2 layout for a feosd whose cgroup is `own`.

    `given` (--vms-cgroup) holds no process, so feosd stays where it is. Otherwise the
    microVMs go beside feosd: feosd moves into the leaf feosd/ of its cgroup, or is there
    already (a restart, a self-upgrade), or stays in the real root, which a container's cgroup
    never is."""
    if given is not None:
        return V2Layout(base=given, leaf=None, controllers=controllers)
    real_root = not container and is_real_root(own)
    if own.name == "feosd" and not real_root:
        return V2Layout(base=own.parent, leaf=None, controllers=controllers)
    if real_root:
        return V2Layout(base=own, leaf=None, controllers=controllers)
    return V2Layout(base=own, leaf=own / "feosd", controllers=controllers)


def v1_layout_for(own: Mapping[str, Path], *, given: Mapping[str, Path] | None = None,
                  container: bool = False) -> V1Layout:
    """The v1 layout for a feosd whose cgroup in each hierarchy is `own`.

    Outside a container feosd stays where it is and vms/ goes below its cgroup (or below
    `given`, --vms-cgroup's). In a container it moves into feosd/ of the container's cgroup,
    as on v2, or is there already."""
    if given is not None:
        return V1Layout(bases=dict(given))
    if not container:
        return V1Layout(bases=dict(own))
    bases, leaves = {}, {}
    for name, path in own.items():
        if path.name == "feosd":
            bases[name] = path.parent
        else:
            bases[name], leaves[name] = path, path / "feosd"
    return V1Layout(bases=bases, leaves=leaves)


def detect(*, proc: Path = Path("/proc/self"), vms_cgroup: str | None = None,
           container: bool | None = None) -> Layout:
    """Which layout serves this host: v2 where the unified hierarchy has cpu and memory, else
    v1 with the hierarchies of cpu, memory and pids that are mounted (cpu at least).

    `container` (default: whether `proc` has a cgroup namespace of its own) puts feosd into
    feosd/ of the container's cgroup and the microVMs beside it."""
    if container is None:
        container = own_cgroup_namespace(proc)
    cgroups = parse_proc_cgroup((proc / "cgroup").read_text())
    mounts = parse_mountinfo((proc / "mountinfo").read_text())
    for m in mounts:
        if m.version == 2 and "" in cgroups:
            available = set((m.mount_point / "cgroup.controllers").read_text().split())
            if set(V2_CONTROLLERS) <= available:
                given = _below(m, vms_cgroup) if vms_cgroup else None
                return v2_layout_for(_below(m, cgroups[""]), given=given, container=container)
    own, named = {}, {}
    for name in V1_HIERARCHIES:
        mount = next((m for m in mounts if m.version == 1 and name in m.controllers), None)
        if mount is not None and name in cgroups:
            own[name] = _below(mount, cgroups[name])
            if vms_cgroup:
                named[name] = _below(mount, vms_cgroup)
    if "cpu" not in own:
        raise FeosError(Code.FAILED_PRECONDITION,
                        "no cgroup hierarchy with the cpu controller: neither v2 with cpu and "
                        "memory nor a v1 cpu hierarchy is mounted")
    return v1_layout_for(own, given=named if vms_cgroup else None, container=container)


# -- plans: the files to write, in order -------------------------------------------------------


@attrs.frozen
class Write:
    """Write `value` into the cgroup file `path`."""

    path: Path
    value: str


def prepare_plan(layout: Layout) -> tuple[list[Path], list[Write]]:
    """The directories to make and the files to write once, before the first microVM."""
    if isinstance(layout, V1Layout):
        return [*layout.leaves.values(), *(layout.vms(h) for h in layout.bases)], []
    enable = " ".join(f"+{c}" for c in layout.controllers)
    dirs = [layout.vms] if layout.leaf is None else [layout.leaf, layout.vms]
    if not enable:
        return dirs, []
    return dirs, [Write(layout.base / "cgroup.subtree_control", enable),
                  Write(layout.vms / "cgroup.subtree_control", enable)]


def vm_dirs(layout: Layout, vm_id: str) -> list[Path]:
    """Every directory of the microVM's cgroup (one per v1 hierarchy, one on v2)."""
    if isinstance(layout, V1Layout):
        return [layout.vms(h) / vm_id for h in layout.bases]
    return [layout.vms / vm_id]


def vm_plan(layout: Layout, vm_id: str, vcpus: int) -> list[Write]:
    """The weight of a microVM's cgroup: nothing else is set, so nothing caps it."""
    if isinstance(layout, V1Layout):
        return [Write(layout.vms("cpu") / vm_id / "cpu.shares", str(shares_of(vcpus)))]
    if "cpu" not in layout.controllers:
        return []
    return [Write(layout.vms / vm_id / "cpu.weight", str(weight_of(vcpus)))]


def jailer_args(layout: Layout, vm_id: str, vcpus: int,
                mounts: Iterable[CgroupMount]) -> list[str] | None:
    """The jailer's cgroup arguments, when the jailer can move Firecracker itself; else None and
    feosd moves it (add_pid) before its first API call.

    The jailer joins <mount>/<--parent-cgroup>/<id> in every hierarchy it is given a file of,
    with one parent for all: that works on v1 when feosd's cgroups are at the same path in each
    hierarchy. On v2 the jailer writes +controller into the subtree_control of every ancestor up
    to the mount, which is "above" feosd's cgroup, so feosd moves it there itself.
    """
    if not isinstance(layout, V1Layout):
        return None
    by_name = {c: m for m in mounts if m.version == 1 for c in m.controllers}
    rels = set()
    for h, base in layout.bases.items():
        mount = by_name.get(h)
        if mount is None or not (base / "vms").is_relative_to(mount.mount_point):
            return None
        rels.add(str((base / "vms").relative_to(mount.mount_point)))
    if len(rels) != 1:
        return None
    args = ["--cgroup-version", "1", "--parent-cgroup", rels.pop()]
    for w in vm_plan(layout, vm_id, vcpus):
        args += ["--cgroup", f"{w.path.name}={w.value}"]
    # a file of each other hierarchy, so that the jailer joins it too; both values are "no cap"
    values = {"memory": "memory.limit_in_bytes=-1", "pids": "pids.max=max"}
    for h in layout.bases:
        if h in values:
            args += ["--cgroup", values[h]]
    return args


# -- doing it ----------------------------------------------------------------------------------


def _write(w: Write) -> None:
    with open(w.path, "w") as f:
        f.write(w.value)


def _move(pid: int, cgroup_dir: Path) -> None:
    try:
        _write(Write(cgroup_dir / "cgroup.procs", str(pid)))
    except ProcessLookupError:
        pass  # the process ended meanwhile: nothing to move
    except OSError as e:
        if e.errno != errno.ESRCH:
            raise


def moves(layout: Layout) -> list[tuple[Path, Path]]:
    """Where feosd's processes move before the controllers are enabled: (from, to) by cgroup,
    one a hierarchy on v1, none when feosd stays."""
    if isinstance(layout, V1Layout):
        return [(layout.bases[h], leaf) for h, leaf in layout.leaves.items()]
    return [] if layout.leaf is None else [(layout.base, layout.leaf)]


def prepare(layout: Layout, *, own_pids: Iterable[int] | None = None) -> None:
    """Make vms/ and the leaf, move feosd's processes into the leaf, and on v2 enable the
    controllers.

    `own_pids` defaults to every process in the base cgroup: all of them are feosd's (the task
    service too; in a container every process of the container's), and the kernel enables no
    controller for children while one stays there. Idempotent: a restart of feosd does it again
    over what is there."""
    dirs, writes = prepare_plan(layout)
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        for base, leaf in moves(layout):
            for pid in pids_in(base) if own_pids is None else own_pids:
                _move(pid, leaf)
        for w in writes:
            _write(w)
    except OSError as e:
        raise FeosError(Code.FAILED_PRECONDITION, f"the microVMs' cgroups: {e}") from e


def create(layout: Layout, vm_id: str, vcpus: int) -> list[Path]:
    """Make the microVM's cgroup and set its weight; returns its directories (for jail.json)."""
    try:
        for d in vm_dirs(layout, vm_id):
            d.mkdir(exist_ok=True)
        for w in vm_plan(layout, vm_id, vcpus):
            _write(w)
    except OSError as e:
        raise FeosError(Code.FAILED_PRECONDITION, f"cgroup of microVM {vm_id}: {e}") from e
    return vm_dirs(layout, vm_id)


def add_pid(layout: Layout, vm_id: str, pid: int) -> None:
    """Move a process, all its threads, into the microVM's cgroup in every hierarchy."""
    try:
        for d in vm_dirs(layout, vm_id):
            _move(pid, d)
    except OSError as e:
        raise FeosError(Code.INTERNAL, f"moving {pid} into the cgroup of {vm_id}: {e}") from e


def pids_in(cgroup_dir: Path) -> list[int]:
    """The processes in a cgroup directory (none if it is gone)."""
    try:
        return [int(p) for p in (cgroup_dir / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def remove_dirs(dirs: Iterable[Path]) -> None:
    """Remove a microVM's cgroup directories that are there; its processes must have ended (the
    kernel refuses a cgroup with processes: EBUSY, reported as FAILED_PRECONDITION)."""
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"cannot remove cgroup {d}: {e.strerror}") from e


def remove(layout: Layout, vm_id: str) -> None:
    remove_dirs(vm_dirs(layout, vm_id))


# -- the hand-over to --vms-cgroup -------------------------------------------------------------

CONTROL_SUBGROUPS = ("feosd", ".control")  # DelegateSubgroup=feosd; systemd's control processes


def unit_cgroup(own: str) -> str:
    """The cgroup of the unit a process runs in (as /proc shows it): feosd's delegated subgroup
    and the subgroup systemd runs a delegated unit's ExecStopPost= in are below it."""
    head, _, name = own.rstrip("/").rpartition("/")
    return (head or "/") if name in CONTROL_SUBGROUPS else own


def hand_over_pairs(old: Layout, new: Layout, vm_id: str) -> list[tuple[Path, Path]]:
    """A microVM's cgroup directories, old and new, hierarchy by hierarchy."""
    if isinstance(old, V2Layout) and isinstance(new, V2Layout):
        return [(old.vms / vm_id, new.vms / vm_id)]
    if isinstance(old, V1Layout) and isinstance(new, V1Layout):
        return [(old.vms(h) / vm_id, new.vms(h) / vm_id) for h in old.bases if h in new.bases]
    return []


WEIGHT_FILES = ("cpu.weight", "cpu.shares")


def _vm_ids(layout: Layout) -> list[str]:
    vms = layout.vms if isinstance(layout, V2Layout) else layout.vms("cpu")
    try:
        return sorted(d.name for d in vms.iterdir() if d.is_dir())
    except FileNotFoundError:
        return []


def hand_over(old: Layout, new: Layout) -> list[str]:
    """Move the microVMs below `old` (a feosd from before --vms-cgroup put them below its own
    cgroup) into `new`, each with its weight; then remove the old vms/ and, on v2, turn the
    controllers off in the old cgroup, so that systemd may start feosd there again. The memory
    charged before stays with the old cgroup. Returns the ids moved. Idempotent."""
    if old == new:
        return []
    ids = _vm_ids(old)
    if not ids:
        return []
    prepare(new)
    try:
        for vm_id in ids:
            for src, dest in hand_over_pairs(old, new, vm_id):
                dest.mkdir(exist_ok=True)
                for name in WEIGHT_FILES:
                    if (src / name).exists():
                        _write(Write(dest / name, (src / name).read_text().strip()))
                for pid in pids_in(src):
                    _move(pid, dest)
                _rmdir_when_empty(src)
        if isinstance(old, V2Layout):
            _rmdir_when_empty(old.vms)
            off = " ".join(f"-{c}" for c in old.controllers)
            if off and not old.vms.exists():
                _write(Write(old.base / "cgroup.subtree_control", off))
        else:
            for h in old.bases:
                _rmdir_when_empty(old.vms(h))
    except OSError as e:
        raise FeosError(Code.FAILED_PRECONDITION, f"handing the microVMs over: {e}") from e
    return ids


def _rmdir_when_empty(d: Path) -> None:
    """rmdir, retried a moment: the kernel empties a cgroup shortly after its tasks moved."""
    import time

    for _ in range(50):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.02)
    d.rmdir()


def own_cgroup(proc: Path = Path("/proc/self")) -> str:
    """This process's cgroup path (cgroup v2's, else the cpu hierarchy's)."""
    cgroups = parse_proc_cgroup((proc / "cgroup").read_text())
    own = cgroups.get("") if _has_v2_controllers(proc) else cgroups.get("cpu")
    if own is None:
        raise FeosError(Code.FAILED_PRECONDITION, "no cgroup of this process is known")
    return own


def _has_v2_controllers(proc: Path) -> bool:
    for m in parse_mountinfo((proc / "mountinfo").read_text()):
        if m.version == 2:
            available = set((m.mount_point / "cgroup.controllers").read_text().split())
            if set(V2_CONTROLLERS) <= available:
                return True
    return False
