"""Build the guest image from Debian's packages and install it as one guest version.

Run by hack/guest-image (as root). Theory of operation:
  1. Gather the inputs (the Debian versions apt would take, the hashes of the build's scripts
     and of the agent's sources); their hash is the version. An installed version with that hash
     is reused at once.
  2. Download the kernel and busybox-static .debs into the work dir's cache (kept by file name,
     which carries the version), debootstrap the root once per package set.
  3. Stage a copy of the root: trim it, add kernel modules and the agent (pure Python: nothing
     of PyPI), compile the bytecode inside the chroot; pack it as erofs. Make the initramfs, the
     vmlinux, the data volume.
  4. Install the staged files as <prefix>/usr/lib/feos/guest/<version>/ by one rename.
Everything but the Debian mirror is offline. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plan

HERE = Path(__file__).resolve().parent
FILES = ("vmlinuz", "vmlinux", "initramfs", "root.erofs", "data.img.zst")
DATA_SIZE = "8G"


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"guest-image: {time.monotonic() - _T0:6.1f}s {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """One step of the build: a line on stderr as it passes, with the time it took (the line's
    first number is the time since the build began). A step that fails says so."""
    began = time.monotonic()
    try:
        yield
    except BaseException:
        log(f"{name} failed after {time.monotonic() - began:.1f}s")
        raise
    log(f"{name} done in {time.monotonic() - began:.1f}s")


def run(*argv: str | Path, cwd: Path | None = None, capture: bool = False) -> str:
    """Run a program; its output goes to stderr (stdout carries the result alone) or back."""
    cmd = [str(a) for a in argv]
    out = subprocess.run(
        cmd, cwd=cwd, check=True, text=True,
        stdout=subprocess.PIPE if capture else sys.stderr,
        env={**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"},
    ).stdout
    return out or ""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def mirror() -> str:
    """The Debian mirror apt is configured with (debootstrap fetches from it)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists() and (uri := _plan.mirror_from_sources(sources.read_text())):
        return uri
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*.list")]:
        if path.exists() and (uri := _plan.mirror_from_list(path.read_text())):
            return uri
    raise SystemExit(f"guest-image: no apt source serves {_plan.SUITE}")


def apt_versions(pkgs: list[str]) -> dict[str, str]:
    """The version apt would take of each package (one apt-cache call: each costs 0.4 s)."""
    found = _plan.candidate_versions(run("apt-cache", "policy", *pkgs, capture=True))
    out: dict[str, str] = {}
    for pkg in pkgs:
        if (version := found.get(pkg)) is None:
            raise SystemExit(f"guest-image: apt has no candidate for {pkg} (apt-get update?)")
        out[pkg] = version
    return out


def agent_sources(repo: Path) -> list[tuple[str, Path]]:
    """(path in /usr/lib/feos-guest, source) for what the root ships of the repo."""
    out = [(name, repo / name) for name in ("feos/__init__.py", "feos/errors.py")]
    for src in sorted((repo / "feos/guest").rglob("*")):
        if src.is_file() and "__pycache__" not in src.parts and src.suffix != ".pyc":
            out.append((str(src.relative_to(repo)), src))
    out += [(f"schema/{p.name}", p) for p in sorted((repo / "schema").glob("*.capnp"))]
    return out


def gather_inputs(repo: Path) -> dict[str, object]:
    kernel = _plan.kernel_package(run("apt-cache", "depends", _plan.KERNEL_META, capture=True))
    scripts = [repo / "hack/guest-image", *sorted(p for p in HERE.iterdir() if p.is_file())]
    versions = apt_versions([kernel, *_plan.ROOT_PACKAGES])
    return {
        "suite": _plan.SUITE,
        "kernel": [kernel, versions.pop(kernel)],
        "packages": versions,
        "scripts": {p.name: sha256_file(p) for p in scripts if p.suffix != ".md"},
        "agent": {dst: sha256_file(src) for dst, src in agent_sources(repo)},
    }


def download_deb(cache: Path, pkg: str, version: str) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{pkg}_{version.replace(':', '%3a')}_*.deb"
    if not (found := sorted(cache.glob(pattern))):
        run("apt-get", "download", "-q", f"{pkg}={version}", cwd=cache)
        found = sorted(cache.glob(pattern))
    if not found:
        raise SystemExit(f"guest-image: apt-get download {pkg}={version} left no {pattern}")
    return found[0]


def extract_once(deb: Path, dest: Path) -> Path:
    """dpkg-deb -x into dest once (a .done marker), so a rebuild does not unpack 400 MB again."""
    if not (dest / ".done").exists():
        shutil.rmtree(dest, ignore_errors=True)
        run("dpkg-deb", "-x", deb, dest)
        (dest / ".done").touch()
    return dest


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF vmlinux of a bzImage: its XZ payload, decompressed (PVH boots it directly)."""
    start = 0
    while (at := bzimage.find(b"\xfd7zXZ\x00", start)) >= 0:
        try:
            out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[at:])
        except lzma.LZMAError:
            out = b""
        if out.startswith(b"\x7fELF"):
            return out
        start = at + 1
    raise SystemExit("guest-image: no XZ-compressed ELF in the kernel image")


def debootstrap(work: Path, mirror_uri: str, packages: dict[str, str]) -> Path:
    """The debootstrap tree for this package set, made once and kept (about 30 s)."""
    key = _plan.tree_key(_plan.SUITE, sorted(packages.items()))
    tree = work / f"rootfs-{key}"
    if (tree / ".done").exists():
        return tree
    tmp = work / f"rootfs-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"debootstrap {_plan.SUITE} from {mirror_uri}")
    run("debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
        _plan.SUITE, tmp, mirror_uri)
    (tmp / ".done").touch()
    tmp.rename(tree)
    return tree


def module_order(kroot: Path, kver: str) -> list[str]:
    """The initramfs modules with their dependencies, in load order, as paths under kroot."""
    outs = [run("modprobe", "-d", kroot, "-S", kver, "--show-depends", m, capture=True)
            for m in _plan.INITRAMFS_MODULES]
    return [str(Path(p).relative_to(kroot)) for p in _plan.module_load_order(outs)]


def base_root(work: Path, tree: Path, kroot: Path, kver: str) -> Path:
    """The root without the agent, kept in the work dir by what makes it.

    The agent's sources change most often; what does not depend on them (the trimmed tree, the
    modules, the standard library's bytecode) is made once per package set and build script,
    and each build links it (cp -al) rather than copying 250 MB.
    """
    scripts = [sha256_file(HERE / n) for n in ("build.py", "_plan.py")]
    base = work / f"base-{_plan.tree_key(tree.name, kver, scripts)}"
    if (base / ".done").exists():
        return base
    tmp = Path(f"{base}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run("cp", "-a", "--reflink=auto", tree, tmp)
    (tmp / ".done").unlink()
    for rel in _plan.ROOT_TRIM:
        shutil.rmtree(tmp / rel, ignore_errors=True)
    for rel in ("data", "run", "tmp", "var/log"):
        (tmp / rel).mkdir(parents=True, exist_ok=True)
    # The root is read-only: what the agent writes lives on /run (tmpfs).
    resolv = tmp / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.symlink_to("../run/resolv.conf")
    log("modules")
    copy_modules(kroot, kver, tmp)
    log("compileall (standard library)")
    compileall(tmp, "-f", "/usr/lib/python3.11", "/usr/lib/python3")
    (tmp / ".done").touch()
    tmp.rename(base)
    return base


def compileall(root: Path, *args: str) -> None:
    # unchecked-hash: a read-only root never changes, so Python need not stat a source's mtime.
    run("chroot", root, "python3", "-m", "compileall", "-q", "-j0",
        "--invalidation-mode", "unchecked-hash", *args)  # fmt: skip


def stage_root(base: Path, repo: Path, root: Path) -> None:
    """The guest's root: the base, hard-linked (never written through), and the agent."""
    shutil.rmtree(root, ignore_errors=True)
    run("cp", "-al", base, root)
    (root / ".done").unlink()
    lib = root / "usr/lib/feos-guest"
    for dst, src in agent_sources(repo):
        (lib / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, lib / dst)
    shutil.copy2(HERE / "feos-guest", lib / "feos-guest")
    log("compileall (agent)")
    compileall(root, "/usr/lib/feos-guest/feos")


def copy_modules(kroot: Path, kver: str, root: Path) -> None:
    """The kernel's modules but for hardware a microVM never has, with their modules.dep."""
    src = kroot / "lib/modules" / kver
    dst = root / "lib/modules" / kver
    skip = tuple(str(src / s) for s in _plan.ROOT_MODULES_SKIP)
    shutil.copytree(
        src, dst, ignore=lambda d, names: [n for n in names if f"{d}/{n}".startswith(skip)]
    )
    strip_signatures(dst)
    run("depmod", "-b", root, kver)


def strip_signatures(tree: Path) -> None:
    for ko in tree.rglob("*.ko"):
        data = ko.read_bytes()
        if (stripped := _plan.strip_module_signature(data)) is not data:
            ko.write_bytes(stripped)


def make_initramfs(kroot: Path, kver: str, busybox_root: Path, stage: Path) -> Path:
    """An uncompressed newc cpio: busybox, /init, the modules, their order (/etc/feos-modules)."""
    tree = stage / "initramfs.d"
    shutil.rmtree(tree, ignore_errors=True)
    for d in ("bin", "sbin", "etc", "dev", "proc", "sys", "root", "lib/modules"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox_root / "bin/busybox", tree / "bin/busybox")
    for applet in run(tree / "bin/busybox", "--list", capture=True).split():
        if applet != "busybox":
            (tree / "bin" / applet).symlink_to("busybox")
    shutil.copy2(HERE / "init", tree / "init")
    (tree / "init").chmod(0o755)
    order = module_order(kroot, kver)
    for rel in order:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(kroot / rel, tree / rel)
    strip_signatures(tree / "lib/modules")
    (tree / "etc/feos-modules").write_text("".join(f"/{rel}\n" for rel in order))
    out = stage / "initramfs"
    names = run("find", ".", "-mindepth", "1", capture=True, cwd=tree)
    with out.open("wb") as f:
        subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "--reproducible"], cwd=tree,
                       input=names.encode(), stdout=f, check=True)
    return out


MKFS_DATA = ("-q", "-F", "-L", "feos-data", "-m", "0",
             "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1")  # fmt: skip


def data_volume(work: Path, e2fsprogs: str) -> Path:
    """The blank data volume: a sparse ext4 file, zstd-compressed (holes compress to nothing).

    Kept in the work dir by what makes it: zstd reads all 8 GiB of holes (about 10 s), and the
    agent's sources, which change most, have nothing to do with it. The inode tables are left
    uninitialised (lazy_itable_init): they read as zeroes from the sparse file, and the guest
    mounts with noinit_itable, so no kernel thread zeroes them under TCG.
    """
    out = work / f"data-{_plan.tree_key(DATA_SIZE, MKFS_DATA, e2fsprogs)}.img.zst"
    if out.exists():
        return out
    img = work / "data.img"
    img.unlink(missing_ok=True)
    run("truncate", "-s", DATA_SIZE, img)
    run("mkfs.ext4", *MKFS_DATA, img)
    run("zstd", "-q", "-f", "-T0", "-3", "--rm", img, "-o", f"{out}.tmp")
    Path(f"{out}.tmp").rename(out)
    return out


def build(repo: Path, work: Path, inputs: dict[str, object], version: str) -> Path:
    stage = work / f"stage-{version}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    debs = work / "debs"
    kernel: tuple[str, str] = inputs["kernel"]  # type: ignore[assignment]
    kpkg, kdebver = kernel
    kver = kpkg.removeprefix("linux-image-")
    packages: dict[str, str] = inputs["packages"]  # type: ignore[assignment]
    bb = packages["busybox-static"]
    with step(f"kernel {kpkg} {kdebver}"):
        kroot = extract_once(download_deb(debs, kpkg, kdebver), work / f"kernel-{kpkg}-{kdebver}")
        if not (kroot / "lib/modules" / kver / "modules.dep").exists():
            run("depmod", "-b", kroot, kver)
        shutil.copy2(kroot / f"boot/vmlinuz-{kver}", stage / "vmlinuz")
        (stage / "vmlinux").write_bytes(extract_vmlinux((stage / "vmlinuz").read_bytes()))
    with step(f"busybox-static {bb}"):
        bbroot = extract_once(download_deb(debs, "busybox-static", bb), work / f"busybox-{bb}")
    with step("initramfs"):
        make_initramfs(kroot, kver, bbroot, stage)
    with step("debootstrap"):
        tree = debootstrap(work, mirror(), packages)
    with step("root"):
        base = base_root(work, tree, kroot, kver)
        stage_root(base, repo, stage / "root.d")
    with step("root.erofs"):
        run("mkfs.erofs", "--quiet", "-zlz4hc", "--preserve-mtime", "--all-root",
            stage / "root.erofs", stage / "root.d")
    with step("data.img.zst"):
        e2fs = run("dpkg-query", "-W", "-f", "${Version}", "e2fsprogs", capture=True)
        shutil.copy2(data_volume(work, e2fs), stage / "data.img.zst")
    with step("manifest"):
        write_manifest(stage, version, kver, inputs)
    return stage


def write_manifest(stage: Path, version: str, kver: str, inputs: dict[str, object]) -> None:
    manifest = {
        "version": version,
        "built": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": kver,
        "files": {name: sha256_file(stage / name) for name in FILES},
        "inputs": inputs,
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def install(stage: Path, dest: Path) -> None:
    """Copy the files next to dest, then rename: a version directory is whole or absent."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (*FILES, "manifest.json"):
        run("cp", "--sparse=always", stage / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


STATE_DIRS = (Path("/var/lib/feos"),)  # feosd's default; --state-dir adds others
VERSION_FILES = ("vmlinux", "initramfs", "root.erofs")  # what a microVM's directory links


def installed(versions: Path) -> dict[str, dict[str, object]]:
    """The manifests of the versions installed in versions (half-made ones have none)."""
    out: dict[str, dict[str, object]] = {}
    for d in sorted(versions.iterdir()) if versions.is_dir() else []:
        if d.name.startswith(".") or not d.is_dir():
            continue
        try:
            out[d.name] = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def versions_in_use(versions: Path, names: list[str], state_dirs: list[Path]) -> set[str]:
    """The versions some microVM uses, by three signs, any of which keeps a version:

    - a file of it has another hard link: a microVM's directory, under any state dir on the
      same filesystem, links it so (feos.vmm's QEMU and Firecracker drivers);
    - a process has a file of it open: a running QEMU or Firecracker, whoever started it (the
      tests' and the benchmark's VMs are no feosd's and link nothing);
    - a symlink under <state dir>/vms/*/*/ points into it: how a microVM links it across
      filesystems (a tmpfs /var/lib/feos), for the state dirs this build knows of.
    """
    dirs = {name: (versions / name).resolve() for name in names}
    used = set()
    for name, d in dirs.items():
        for f in VERSION_FILES:
            try:
                if (d / f).stat().st_nlink > 1:
                    used.add(name)
            except OSError:
                pass
    for target in _open_files() + _state_links(state_dirs):
        for name, d in dirs.items():
            if target.parent == d:
                used.add(name)
    return used


def _open_files() -> list[Path]:
    out = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                out.append(Path(os.readlink(fd)))
            except OSError:
                pass
    return out


def _state_links(state_dirs: list[Path]) -> list[Path]:
    out = []
    for state in state_dirs:
        for link in state.glob("vms/*/*/*"):
            if link.is_symlink():
                out.append(link.resolve())
    return out


def prune(versions: Path, keep_hours: float, state_dirs: list[Path]) -> list[str]:
    """Remove the versions _plan.versions_to_prune picks; the names of those removed."""
    manifests = installed(versions)
    in_use = versions_in_use(versions, list(manifests), state_dirs)
    gone = _plan.versions_to_prune(manifests, in_use, time.time(), keep_hours=keep_hours)
    for name in gone:
        # Out of the way first (a rename), so that no reader sees a half-removed version.
        doomed = versions / f".{name}.pruned-{os.getpid()}"
        (versions / name).rename(doomed)
        shutil.rmtree(doomed)
        log(f"pruned version {name} (built {manifests[name].get('built')}, not in use)")
    return gone


def guest_dir(prefix: Path | None) -> Path:
    """Where versions go: PREFIX/usr/lib/feos/guest; without --prefix, $FEOS_GUEST_DIR (which
    feosd and the tests read) or /usr/lib/feos/guest."""
    if prefix is None and (env := os.environ.get("FEOS_GUEST_DIR")):
        return Path(env)
    return (prefix or Path("/")) / "usr/lib/feos/guest"


@contextlib.contextmanager
def _build_lock(work: Path) -> Iterator[None]:
    """One build or prune at a time in a work dir: the test suites of several engineers share it."""
    work.mkdir(parents=True, exist_ok=True)
    with (work / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/guest-image", description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=Path, default=None,
                    help="install into PREFIX/usr/lib/feos/guest (default: $FEOS_GUEST_DIR or /)")
    ap.add_argument("--work", type=Path, default=Path("/var/cache/feos-guest-build"))
    ap.add_argument("--repo", type=Path, default=HERE.parent.parent)
    ap.add_argument("--force", action="store_true", help="build even if the version is installed")
    ap.add_argument("--keep-all", action="store_true",
                    help="remove no old version after installing one (see README: pruning)")
    ap.add_argument("--keep-hours", type=float, default=_plan.KEEP_HOURS,
                    help="keep every version built less than this long ago (default 24)")
    ap.add_argument("--state-dir", type=Path, action="append", default=[],
                    help="a feosd state dir whose microVMs may link versions by symlink "
                         "(besides /var/lib/feos); repeatable")  # fmt: skip
    ap.add_argument("--prune-only", action="store_true", help="build nothing: only prune")
    args = ap.parse_args(argv)
    if args.prune_only:
        with _build_lock(args.work):
            prune(guest_dir(args.prefix), args.keep_hours, [*STATE_DIRS, *args.state_dir])
        return 0
    repo = args.repo.resolve()
    with step("inputs"):
        inputs = gather_inputs(repo)
    version = _plan.input_version(inputs)
    dest = guest_dir(args.prefix) / version
    if (dest / "manifest.json").exists() and not args.force:
        log(f"version {version} is installed")
        print(dest)
        return 0
    with _build_lock(args.work):
        if (dest / "manifest.json").exists() and not args.force:
            log(f"version {version} was installed while this waited")
        else:
            log(f"building version {version} in {args.work}")
            stage = build(repo, args.work, inputs, version)
            with step(f"install {dest}"):
                dest.parent.mkdir(parents=True, exist_ok=True)
                install(stage, dest)
                shutil.rmtree(stage)
            if not args.keep_all:
                prune(dest.parent, args.keep_hours, [*STATE_DIRS, *args.state_dir])
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
