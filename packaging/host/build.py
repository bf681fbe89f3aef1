"""Build the node image: a kernel and one initramfs that holds the whole node (FeOS as the node's
operating system: feos-host-init as PID 1, feosd, diskd, Firecracker and a guest version).

Run by hack/host-image (as root). Theory of operation, the guest build's (packaging/guest), whose
steps it reuses:
  1. The inputs: the kernel package and the root's Debian packages (the versions apt would
     take), the sha256 of every file of feos/ and schema/ shipped, of this folder's scripts, and
     the Python packages feos needs with their versions (taken from the build's venv: the
     project's .deb packages are to replace this, docs/host-init.md). Their hash is the image's
     version; a built version is reused at once.
  2. The kernel (Debian's linux-image-amd64, the guest's), debootstrap of the root's packages
     (kept by package set), all the kernel's modules (a real machine needs its drivers).
  3. The root: the Debian tree trimmed (TRIM, then the shared libraries nothing needs),
     /usr/lib/feos/python (feos, schema, the venv's packages feos needs, their compiled
     modules stripped, their C and Cython sources left out), the launchers, Firecracker
     (hack/firecracker), a guest version (hack/guest-image) without the vmlinuz feosd does not
     boot, bytecode compiled by the root's own python3; /init is feos-host-init.
  4. One newc cpio of it all (uncompressed: under TCG the kernel would spend seconds
     decompressing; a PXE server or a USB stick can gzip it, docs/host-init.md), vmlinuz and
     the ELF vmlinux (PVH, for QEMU's microvm), a manifest.
Output: <out>/<version>/{vmlinuz,vmlinux,initramfs,manifest.json}; stdout's last line is it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "packaging/guest"))
import _plan as gplan  # noqa: E402

_spec = importlib.util.spec_from_file_location("guest_build", REPO / "packaging/guest/build.py")
assert _spec is not None
assert _spec.loader is not None
gbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gbuild)

ROOT_PACKAGES = [
    "python3", "kmod", "iproute2", "nftables", "conntrack", "e2fsprogs", "qemu-utils",
    "qemu-system-common", "crun", "util-linux", "procps", "fuse3", "zstd",
    "erofs-utils", "busybox-static", "ca-certificates",
]  # fmt: skip
# The Python packages feos runs with (pyproject's dependencies), closed over their requirements,
# but for hypothesis (tests only). boto3's family stays: diskd imports it at its start even
# without an object store.
PY_REQUIREMENTS = [
    "trio", "pycapnp", "pyroute2", "cffi", "h2", "attrs", "cattrs", "pip-nftables", "pyyaml",
    "h11", "hypercorn", "cryptography", "ntplib", "trustme",
]  # fmt: skip
PY_REQUIREMENTS.append("boto3")
PY_SKIP = {"hypothesis"}
# What of the Debian tree the node never runs (every MB is copied by the kernel at each boot,
# 20 ms a MB under TCG): documents, apt, dpkg's scripts, perl (only maintainer scripts use it),
# glibc's iconv modules (no program of the node converts charsets), qemu-system's UI, audio and
# display plugins (qemu-storage-daemon loads none), Python's pydoc data and regression tests.
TRIM = ["usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
        "var/cache/apt", "var/lib/apt/lists", "usr/share/qemu/edk2-arm-code.fd",
        "usr/share/qemu/edk2-arm-vars.fd", "usr/share/qemu/edk2-aarch64-code.fd",
        "usr/bin/apt*", "usr/lib/apt", "etc/apt", "var/lib/dpkg/info", "usr/bin/perl*",
        "usr/lib/x86_64-linux-gnu/perl-base", "usr/lib/x86_64-linux-gnu/perl",
        "usr/share/perl*", "usr/lib/x86_64-linux-gnu/gconv", "usr/share/iso-codes",
        "usr/share/xml/iso-codes", "usr/lib/x86_64-linux-gnu/qemu",
        "usr/lib/x86_64-linux-gnu/gstreamer*", "usr/libexec/gstreamer*",
        "usr/lib/python3.11/pydoc_data", "usr/lib/python3.11/test"]  # fmt: skip
# Shared libraries kept although no program names them (DT_NEEDED): glibc's own (it loads NSS
# modules, libgcc_s for cancellation, libidn2 for IDN names) and what Python loads by ctypes.
LIBS_KEPT = ("libc.so", "libc_malloc", "ld-linux", "libm.so", "libmvec", "libpthread", "libdl",
             "librt", "libresolv", "libnss_", "libutil", "libanl", "libBrokenLocale",
             "libthread_db", "libmemusage", "libpcprofile", "libgcc_s", "libidn2",
             "libnftables")  # fmt: skip
LIBDIR = "usr/lib/x86_64-linux-gnu"
# Modules no node boots with (sound, video, radios, sensors, input devices), 250 MB of the 390:
# a node's drivers are its NICs, disks, virtio, netfilter and filesystems.
MODULES_SKIP = [
    "sound", "drivers/gpu", "drivers/media", "drivers/iio", "drivers/infiniband",
    "drivers/staging", "drivers/comedi", "drivers/hid", "drivers/input", "drivers/bluetooth",
    "drivers/isdn", "drivers/hwmon", "drivers/video", "drivers/w1", "drivers/leds",
    "drivers/mmc", "drivers/memstick", "drivers/mtd", "drivers/nfc", "drivers/power",
    "drivers/thunderbolt", "drivers/usb", "drivers/spi", "drivers/gnss", "drivers/parport",
    "drivers/pcmcia", "drivers/net/wireless", "drivers/net/can", "drivers/net/usb",
    "drivers/net/ieee802154", "drivers/net/hamradio", "drivers/atm", "drivers/firewire",
    "net/wireless", "net/mac80211", "net/bluetooth", "net/nfc", "net/can", "net/6lowpan",
    "net/ieee802154", "net/mac802154", "net/atm", "fs/ocfs2", "fs/gfs2", "fs/nls",
]  # fmt: skip
PYLIB = "usr/lib/feos/python"
LAUNCHERS = {
    "usr/sbin/feos-host-init": "from feos.hostinit import main",
    "usr/sbin/feosd": "from feos.daemon import main",
    "usr/sbin/diskd": "from feos.disk import main",
    "usr/bin/feosctl": "from feos.cli import main",
}
IMPORT_MARKER = "FEOS-FEOSD-IMPORTED"
FILES = ("vmlinuz", "vmlinux", "initramfs")

log = gbuild.log
step = gbuild.step
run = gbuild.run


def py_distributions() -> dict[str, md.Distribution]:
    """The distributions of PY_REQUIREMENTS and what they require (no extras), by name."""
    from packaging.requirements import Requirement  # the venv's (pip and pytest need it)

    found: dict[str, md.Distribution] = {}
    todo = [Requirement(r) for r in PY_REQUIREMENTS]
    env = {"python_version": "3.11", "python_full_version": "3.11.2", "extra": ""}
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in found or name in PY_SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        found[name] = dist = md.distribution(name)
        todo += [Requirement(r) for r in dist.requires or []]
    return found


def feos_sources() -> list[Path]:
    out = []
    for top in ("feos", "schema"):
        for p in sorted((REPO / top).rglob("*")):
            skip = "__pycache__" in p.parts or p.suffix in (".pyc", ".c", ".o")
            if p.is_file() and not skip:
                out.append(p)
    return out


def gather_inputs() -> dict[str, object]:
    kernel = gplan.kernel_package(run("apt-cache", "depends", gplan.KERNEL_META, capture=True))
    versions = gbuild.apt_versions([kernel, *ROOT_PACKAGES])
    scripts = [REPO / "hack/host-image", *sorted(p for p in HERE.iterdir() if p.is_file())]
    return {
        "suite": gplan.SUITE,
        "kernel": [kernel, versions.pop(kernel)],
        "packages": versions,
        "python": {n: d.version for n, d in sorted(py_distributions().items())},
        "scripts": {p.name: gbuild.sha256_file(p) for p in scripts if p.suffix != ".md"},
        "feos": {str(p.relative_to(REPO)): gbuild.sha256_file(p) for p in feos_sources()},
    }


def version_of(inputs: dict[str, object]) -> str:
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def base_root(work: Path, tree: Path, kroot: Path, kver: str) -> Path:
    """The Debian tree trimmed, with every module of the kernel and the stdlib's bytecode: made
    once per package set, kernel and this script, then linked into each build (cp -al)."""
    script = gbuild.sha256_file(HERE / "build.py")
    base = work / f"hostbase-{gplan.tree_key(tree.name, kver, script)}"
    if (base / ".done").exists():
        return base
    tmp = Path(f"{base}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run("cp", "-a", "--reflink=auto", tree, tmp)
    (tmp / ".done").unlink()
    for rel in TRIM:
        for path in tmp.glob(rel):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    prune_libraries(tmp)
    src = kroot / "lib/modules" / kver
    skip = tuple(str(src / "kernel" / s) for s in MODULES_SKIP)
    shutil.copytree(src, tmp / "lib/modules" / kver, symlinks=True,
                    ignore=lambda d, names: [n for n in names if f"{d}/{n}".startswith(skip)])
    gbuild.strip_signatures(tmp / "lib/modules" / kver)
    compress_modules(tmp / "lib/modules" / kver)
    run("depmod", "-b", tmp, kver)
    gbuild.compileall(tmp, "-f", "/usr/lib/python3.11", "/usr/lib/python3")
    (tmp / ".done").touch()
    tmp.rename(base)
    for old in work.glob("hostbase-*"):  # each is 400 MB: only the one this script makes stays
        if old != base:
            shutil.rmtree(old, ignore_errors=True)
    return base


def _elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _needed(files: list[Path]) -> dict[Path, list[str]]:
    """Each ELF file's DT_NEEDED names (readelf, a few hundred files a call)."""
    out: dict[Path, list[str]] = {}
    for i in range(0, len(files), 300):
        text = run("readelf", "-d", "-W", *files[i : i + 300], capture=True)
        current: list[str] = []
        for line in text.splitlines():
            if line.startswith("File: "):
                current = out.setdefault(Path(line[6:].strip()), [])
            elif "(NEEDED)" in line and "[" in line:
                current.append(line.rsplit("[", 1)[1].rstrip("]"))
    return out


def prune_libraries(root: Path) -> None:
    """The shared libraries of LIBDIR that no program, Python module or library of the root
    needs (after TRIM: what qemu-system's plugins pulled in), but for LIBS_KEPT."""
    libdir = root / LIBDIR
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and _elf(p)]
    libs = {p for p in files if p.parent == libdir and ".so" in p.name}
    needed = _needed(files)
    by_name = {p.name: p.resolve() for p in libdir.iterdir() if ".so" in p.name}
    used: set[Path] = set()
    todo = [p for p in files if p not in libs]
    while todo:
        for name in needed.get(todo.pop(), []):
            lib = by_name.get(name)
            if lib is not None and lib not in used:
                used.add(lib)
                todo.append(lib)
    gone = [p for p in libs if p not in used and not p.name.startswith(LIBS_KEPT)]
    for p in gone:
        p.unlink()
    for link in libdir.iterdir():  # the names of what went
        if link.is_symlink() and not link.exists():
            link.unlink()
    run("ldconfig", "-r", root)
    log(f"pruned {len(gone)} shared libraries no program needs")


def prune(out: Path, keep: int = 3) -> None:
    """The newest `keep` images stay, and any a process holds open (a QEMU booting it)."""
    images = sorted((d for d in out.iterdir() if (d / "manifest.json").exists()),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    held = {p.parent for p in gbuild._open_files()}
    for d in images[keep:]:
        if d not in held:
            shutil.rmtree(d, ignore_errors=True)
            log(f"pruned node image {d.name}")


def compress_modules(tree: Path) -> None:
    """zstd each module (170 MB to about 45 MB of the initramfs): kmod's modprobe unpacks one
    as it loads it (Debian's kmod has +ZSTD), and only the modules loaded pay for it."""
    kos = [str(p) for p in tree.rglob("*.ko")]
    for i in range(0, len(kos), 500):
        run("zstd", "-q", "-T0", "-9", "--rm", *kos[i : i + 500])


# botocore's service models: diskd's object store speaks S3 alone (25 MB of 28 are the others)
BOTOCORE_DATA_KEEP = {"s3", "sts"}


# the C++ and Cython sources a compiled package carries (pycapnp's 7 MB capnp.cpp)
SOURCE_SUFFIXES = {".cpp", ".pyx", ".pxd", ".h", ".c"}


def _unneeded(parts: tuple[str, ...]) -> bool:
    if Path(parts[-1]).suffix in SOURCE_SUFFIXES:
        return True
    return (len(parts) > 3 and parts[:2] == ("botocore", "data")
            and parts[2] not in BOTOCORE_DATA_KEEP)


def strip_libraries(tree: Path) -> None:
    """The debugging sections and static symbols of the Python packages' compiled modules
    (pycapnp's debugging sections were 75 % of its 20 MB), as Debian strips a shared library:
    `strip --strip-unneeded` keeps the dynamic symbols the loader uses."""
    sos = [str(p) for p in tree.rglob("*.so") if p.is_file() and not p.is_symlink()]
    if sos:
        run("strip", "--strip-unneeded", *sos)


def add_feos(root: Path) -> None:
    lib = root / PYLIB
    for src in feos_sources():
        dst = lib / src.relative_to(REPO)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    for dist in py_distributions().values():
        for f in dist.files or []:
            src = Path(str(dist.locate_file(f)))
            if ".." in f.parts or (f.parts[0].endswith(".dist-info") and f.name != "METADATA"):
                continue
            if "__pycache__" in f.parts or not src.is_file() or _unneeded(f.parts):
                continue
            dst = lib / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    strip_libraries(lib)
    for rel, line in LAUNCHERS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "#!/usr/bin/python3 -E\nimport sys\n"
            f"sys.path.insert(0, '/{PYLIB}')\n{line}\n\nmain()\n"
        )
        path.chmod(0o755)
    # The bench's other init: feosd's main module imported, a marker, a power-off.
    marker = root / "usr/sbin/feos-import-marker"
    marker.write_text(
        "#!/usr/bin/python3 -E\nimport ctypes, sys\n"
        f"sys.path.insert(0, '/{PYLIB}')\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "for fs, at in ((b'proc', b'/proc'), (b'sysfs', b'/sys'), (b'devtmpfs', b'/dev')):\n"
        "    libc.mount(fs, at, fs, 0, None)\n"
        "import feos.daemon\n"
        f"print('{IMPORT_MARKER}', flush=True)\n"
        "libc.reboot(0x4321FEDC)\n"
    )
    marker.chmod(0o755)


def add_programs(root: Path, guest: str) -> None:
    run(REPO / "hack/firecracker", "--prefix", root)
    dst = root / "usr/lib/feos/guest" / Path(guest).name
    dst.parent.mkdir(parents=True, exist_ok=True)
    run("cp", "-a", "--sparse=always", guest, dst)
    (dst / "vmlinuz").unlink(missing_ok=True)  # feosd boots the guest's vmlinux: 8 MB less


def finish_root(root: Path) -> None:
    init = root / "init"
    init.unlink(missing_ok=True)
    init.symlink_to("usr/sbin/feos-host-init")
    (root / "etc/hostname").write_text("feos\n")
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text("# the initramfs's resolvers, until DHCP names any\n"
                      "nameserver 2001:4860:4860::8888\nnameserver 8.8.8.8\n"
                      "nameserver 2606:4700:4700::1111\nnameserver 1.1.1.1\n")
    # feos and its packages for every python3 of the node, as the launchers' children run it
    # (feosd's probes run `python3 -m feos...`)
    (root / "usr/lib/python3/dist-packages/feos.pth").write_text(f"/{PYLIB}\n")
    for d in ("proc", "sys", "dev", "run", "tmp", "var/lib/feos"):
        (root / d).mkdir(parents=True, exist_ok=True)
    gbuild.compileall(root, f"/{PYLIB}")


def cpio(root: Path, out: Path) -> None:
    names = run("find", ".", "-mindepth", "1", capture=True, cwd=root)
    with out.open("wb") as f:
        subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "--reproducible"], cwd=root,
                       input=names.encode(), stdout=f, check=True)


def build(work: Path, inputs: dict[str, object], version: str, out: Path, guest: str) -> Path:
    stage = work / f"hoststage-{version}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    kpkg, kdebver = inputs["kernel"]  # type: ignore[misc]
    kver = kpkg.removeprefix("linux-image-")
    packages: dict[str, str] = inputs["packages"]  # type: ignore[assignment]
    with step(f"kernel {kpkg} {kdebver}"):
        kroot = gbuild.extract_once(gbuild.download_deb(work / "debs", kpkg, kdebver),
                                    work / f"kernel-{kpkg}-{kdebver}")
        if not (kroot / "lib/modules" / kver / "modules.dep").exists():
            run("depmod", "-b", kroot, kver)
        shutil.copy2(kroot / f"boot/vmlinuz-{kver}", stage / "vmlinuz")
        (stage / "vmlinux").write_bytes(gbuild.extract_vmlinux((stage / "vmlinuz").read_bytes()))
    with step("debootstrap"):
        tree = gbuild.debootstrap(work, gbuild.mirror(), packages)
    with step("base root"):
        base = base_root(work, tree, kroot, kver)
    root = stage / "root.d"
    with step("root"):
        run("cp", "-al", base, root)
        (root / ".done").unlink()
        add_feos(root)
        add_programs(root, guest)
        finish_root(root)
    with step("initramfs"):
        cpio(root, stage / "initramfs")
        shutil.rmtree(root)
    manifest = {
        "version": version, "kernel": kver,
        "built": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": {n: gbuild.sha256_file(stage / n) for n in FILES}, "inputs": inputs,
    }  # fmt: skip
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    dest = out / version
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    stage.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/host-image", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/var/cache/feos-host-image"),
                    help="where versions go (default /var/cache/feos-host-image)")
    ap.add_argument("--work", type=Path, default=Path("/var/cache/feos-guest-build"),
                    help="the build's cache, shared with the guest's (default %(default)s)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    with step("inputs"):
        inputs = gather_inputs()
    version = version_of(inputs)
    dest = args.out / version
    if (dest / "manifest.json").exists() and not args.force:
        log(f"node image {version} is built")
        print(dest)
        return 0
    with step("guest version (hack/guest-image)"):  # before the lock: it takes it too
        guest = run(REPO / "hack/guest-image", capture=True).strip().splitlines()[-1]
    with gbuild._build_lock(args.work):
        if not (dest / "manifest.json").exists() or args.force:
            log(f"building node image {version}")
            build(args.work, inputs, version, args.out, guest)
            prune(args.out)
    print(dest)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
