#!/usr/bin/env python3
"""Build feos's Debian packages for Debian 12 and 13 into a directory of .debs.

usage: packaging/deb/build.py [--dist bookworm|trixie|all] [--out DIR] [--version V | --release]
                              [--guest-dir DIR] [--firecracker-dir DIR]

Writes OUT/<codename>/*.deb (default OUT: build/deb) and prints each .deb's path, one a line, on
stdout; progress goes to stderr. The version is pyproject's with ~dev.<UTC time>.<commit> for
HEAD (below the release it leads to), or pyproject's alone with --release. docs/packaging.md says
what each package holds; _plan.py decides it. Run as root on Debian 12 with hack/packages.apt
installed: pip (from the repo's venv) fetches the wheels of the distribution's python3 at build
time, so that nothing is fetched at install time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path(os.environ.get("FEOS_DEB_CACHE", "/var/cache/feos-deb-build"))

LAUNCHERS = {  # path in the package -> the entry point (pyproject's [project.scripts])
    "feosd": {"usr/sbin/feosd": "feos.daemon:main"},
    "feosctl": {"usr/bin/feosctl": "feos.cli:main"},
    "diskd": {"usr/sbin/diskd": "feos.disk:main", "usr/sbin/diskctl": "feos.disk:ctl"},
}

FILES = {  # package -> (file in files/, path in the package, mode)
    "feosd": [
        ("feosd.service", "usr/lib/systemd/system/feosd.service", 0o644),
        ("feos-vms.service", "usr/lib/systemd/system/feos-vms.service", 0o644),
        ("feosd.socket", "usr/lib/systemd/system/feosd.socket", 0o644),
        ("feosd.sysusers", "usr/lib/sysusers.d/feosd.conf", 0o644),
        ("feosd.default", "etc/default/feosd", 0o644),
        ("50feosd", "etc/apt/apt.conf.d/50feosd", 0o644),
        ("feosd.socket-address.conf", "usr/share/doc/feosd/examples/feosd.socket.d/address.conf",
         0o644),
    ],
    "diskd": [
        ("diskd.service", "usr/lib/systemd/system/diskd.service", 0o644),
        ("diskd.default", "etc/default/diskd", 0o600),
        ("diskd.modules-load", "usr/lib/modules-load.d/diskd.conf", 0o644),
    ],
}


def log(msg: str) -> None:
    print(f"packages: {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, capture: bool = False, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, check=False, text=True, cwd=cwd,
                          stdout=subprocess.PIPE if capture else sys.stderr)
    if done.returncode != 0:
        raise SystemExit(f"packages: {' '.join(cmd)} failed with exit status {done.returncode}")
    return done.stdout or ""


def project() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def build_version(release: bool) -> str:
    upstream = str(project()["version"])
    if release:
        return _plan.check_upstream(upstream)
    commit = run("git", "-C", str(REPO), "rev-parse", "HEAD", capture=True).strip()
    return _plan.dev_version(upstream, time.time(), commit)


# -- the Python package and its dependencies -------------------------------------------------


def pip() -> list[str]:
    venv = REPO / ".venv/bin/python"
    return [str(venv) if venv.exists() else sys.executable, "-m", "pip"]


def vendored_dependencies(dist: _plan.Dist) -> Path:
    """pyproject's dependencies as wheels for the distribution's python3, installed into a
    directory (cached by the dependency list: pip resolves once per change)."""
    deps = [str(d) for d in project()["dependencies"]]  # type: ignore[attr-defined]
    key = hashlib.sha256(json.dumps([dist.python, deps]).encode()).hexdigest()[:12]
    target = CACHE / f"python-{dist.python_tag}-{key}"
    if (target / ".complete").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"wheels for Python {dist.python} ({dist.codename}) into {target}")
    platform_args = [a for p in _plan.platforms(_plan.GLIBC[dist.codename])
                     for a in ("--platform", p)]
    run(*pip(), "install", "--quiet", "--disable-pip-version-check", "--no-compile",
        "--only-binary=:all:", "--target", str(tmp), "--python-version", dist.python,
        "--implementation", "cp", "--abi", dist.python_tag, "--abi", "abi3", "--abi", "none",
        *platform_args, *deps)
    shutil.rmtree(tmp / "bin", ignore_errors=True)  # the wheels' console scripts: not ours
    (tmp / ".complete").write_text("")
    tmp.rename(target)
    return target


def copy_feos(dest: Path) -> None:
    """The feos package of the work tree, with its compiled feos._native and feos._nghttp2
    (abi3: one build serves every python3 from 3.11 on)."""
    native = REPO / "feos/_native.abi3.so"
    if not native.exists():
        run(*pip()[:1], str(REPO / "native/build.py"), cwd=REPO)
    shutil.copytree(REPO / "feos", dest / "feos", ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "_native.c", "_native.*.tmp", "_nghttp2.c", "_nghttp2.*.tmp",
        "*.o"))
    # the Cap'n Proto schemas, where feos._schema looks first (beside the package's modules)
    shutil.copytree(REPO / "schema", dest / "feos/schema",
                    ignore=shutil.ignore_patterns("*.py", "__pycache__"))


def launcher(entry: str) -> str:
    module, func = entry.split(":")
    return ("#!/usr/bin/python3 -I\n"
            "# feos's programs run on Debian's python3 with feos's own packages (feos-python)\n"
            "import sys\n"
            "sys.path.insert(0, '/usr/lib/feos/python')\n"
            f"from {module} import {func}\n"
            f"sys.exit({func}())\n")


# -- Firecracker and the guest ----------------------------------------------------------------


def default_firecracker() -> Path:
    """The pinned Firecracker, as hack/firecracker lays it out under a prefix of our own."""
    prefix = CACHE / "firecracker"
    run(str(REPO / "hack/firecracker"), "--prefix", str(prefix))
    versions = sorted((prefix / "usr/lib/feos/firecracker").iterdir())
    return versions[-1]


def default_guest() -> Path:
    """The guest image of the work tree, built (or reused) by hack/guest-image."""
    out = run(str(REPO / "hack/guest-image"), "--keep-all", capture=True)
    return Path(out.strip().splitlines()[-1])


def guest_build_version(guest_dir: Path) -> str:
    """The guest package's version: when its image was built (a newer image sorts higher)."""
    built = json.loads((guest_dir / "manifest.json").read_text())["built"]
    stamp = time.strptime(built.replace("+00:00", ""), "%Y-%m-%dT%H:%M:%S")
    return time.strftime("%Y%m%d%H%M%S", stamp)


# -- packages ---------------------------------------------------------------------------------


def tree_kib(root: Path) -> int:
    total = 0
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and "DEBIAN" not in p.relative_to(root).parts:
            total += p.stat().st_size
    return total // 1024 + 1


def stage_package(pkg: _plan.Package, dist: _plan.Dist, stage: Path, *, python_dir: Path,
                  fc_dir: Path, guest_dir: Path) -> None:
    if pkg.name == "feos-python":
        dest = stage / "usr/lib/feos/python"
        shutil.copytree(python_dir, dest, ignore=shutil.ignore_patterns(".complete"))
        copy_feos(dest)
    for path, entry in LAUNCHERS.get(pkg.name, {}).items():
        (stage / path).parent.mkdir(parents=True, exist_ok=True)
        (stage / path).write_text(launcher(entry))
        (stage / path).chmod(0o755)
    for src, path, mode in FILES.get(pkg.name, []):
        text = (HERE / "files" / src).read_text()
        if src.endswith((".service", ".socket")):
            text = _plan.unit_text(text, dist)
        (stage / path).parent.mkdir(parents=True, exist_ok=True)
        (stage / path).write_text(text)
        (stage / path).chmod(mode)
    if pkg.name.startswith("feos-firecracker-"):
        dest = stage / "usr/lib/feos/firecracker" / fc_dir.name
        dest.mkdir(parents=True)
        for name in ("firecracker", "jailer"):
            shutil.copy2(fc_dir / name, dest / name)
    if pkg.name.startswith("feos-guest-"):
        dest = stage / "usr/lib/feos/guest" / guest_dir.name
        dest.mkdir(parents=True)
        for f in sorted(guest_dir.iterdir()):
            if f.is_file():
                shutil.copy2(f, dest / f.name)


def build_deb(pkg: _plan.Package, dist: _plan.Dist, out: Path, work: Path, **dirs: Path) -> Path:
    stage = work / pkg.name
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "DEBIAN").mkdir(parents=True)
    stage_package(pkg, dist, stage, **dirs)
    (stage / "DEBIAN/control").write_text(_plan.control(pkg, tree_kib(stage)))
    if pkg.conffiles:
        (stage / "DEBIAN/conffiles").write_text("".join(f"{c}\n" for c in pkg.conffiles))
    for script in ("preinst", "postinst", "prerm", "postrm"):
        src = HERE / "scripts" / f"{pkg.name}.{script}"
        if src.exists():
            shutil.copy2(src, stage / "DEBIAN" / script)
            (stage / "DEBIAN" / script).chmod(0o755)
    deb = out / f"{pkg.name}_{pkg.version}_{pkg.architecture}.deb"
    # the guest's files are compressed already (erofs, zstd): a light gzip is enough
    level = "1" if pkg.name.startswith("feos-guest-") else "6"
    run("dpkg-deb", "--root-owner-group", "-Zgzip", f"-z{level}", "--build", str(stage),
        str(deb))
    shutil.rmtree(stage)
    return deb


def link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where it can be (a guest package is 200 MB), else a copy."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def build(dists: list[_plan.Dist], out: Path, version: str, guest_dir: Path,
          fc_dir: Path) -> list[Path]:
    debs: list[Path] = []
    guest_version = guest_build_version(guest_dir)
    for dist in dists:
        dest = out / dist.codename
        dest.mkdir(parents=True, exist_ok=True)
        python_dir = vendored_dependencies(dist)
        work = CACHE / f"stage-{os.getpid()}-{dist.codename}"
        try:
            for pkg in _plan.packages(version, dist, guest=guest_dir.name,
                                      firecracker=fc_dir.name, guest_build=guest_version):
                shared = pkg.name.startswith(("feos-guest", "feos-firecracker"))
                name = f"{pkg.name}_{pkg.version}_{pkg.architecture}.deb"
                built = [d for d in debs if d.name == name]
                if shared and built:  # built once: the same for every distribution
                    link_or_copy(built[0], dest / name)
                if shared and (dest / name).exists():  # its name says its contents
                    debs.append(dest / name)
                    continue
                log(f"{dist.codename}: {pkg.name} {pkg.version}")
                debs.append(build_deb(pkg, dist, dest, work, python_dir=python_dir,
                                      fc_dir=fc_dir, guest_dir=guest_dir))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return debs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packaging/deb/build.py", description=__doc__.split("\n")[0])
    p.add_argument("--dist", choices=[*_plan.DISTS, "all"], default="all")
    p.add_argument("--out", type=Path, default=REPO / "build/deb")
    p.add_argument("--version", help="the upstream version (default: pyproject's, ~dev for HEAD)")
    p.add_argument("--release", action="store_true", help="pyproject's version, without ~dev")
    p.add_argument("--guest-dir", type=Path, help="an installed guest version (default: "
                   "hack/guest-image's)")
    p.add_argument("--firecracker-dir", type=Path, help="a Firecracker version's directory "
                   "(default: hack/firecracker's pinned one)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("packages: run as root (the guest image's build and dpkg-deb's owners)")
    version = (_plan.check_upstream(args.version) if args.version
               else build_version(args.release))
    dists = list(_plan.DISTS.values()) if args.dist == "all" else [_plan.DISTS[args.dist]]
    guest = args.guest_dir or default_guest()
    fc = args.firecracker_dir or default_firecracker()
    for needed, what in ((guest / "manifest.json", "a guest version's manifest.json"),
                         (fc / "firecracker", "firecracker")):
        if not needed.exists():
            raise SystemExit(f"packages: {needed} is missing ({what})")
    CACHE.mkdir(parents=True, exist_ok=True)
    for deb in build(dists, args.out.resolve(), version, guest.resolve(), fc.resolve()):
        print(deb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
