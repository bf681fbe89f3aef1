#!/usr/bin/env python3
"""Publish built .debs into an apt repository signed by a key of its own.

usage: packaging/deb/repo.py --repo DIR [--gnupg-home DIR] BUILD_DIR...

BUILD_DIR is what packaging/deb/build.py wrote (<codename>/*.deb below it). The repository keeps
what was published before: the .debs go into pool/main/<codename>/, and each distribution's
index (dists/<codename>/main/binary-amd64/Packages) is made anew from its pool, so every version
ever published stays installable (`apt-get install feosd=VERSION`). Release is signed into
InRelease and Release.gpg; the key's public half is DIR/feos.gpg, the file an apt source's
signed-by names. dists/stable and dists/oldstable name Debian 13's and 12's. The key lives in
--gnupg-home (default DIR.key, never inside the published tree); the first publish makes one.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plan

KEY_NAME = "feos packages (apt repository signing key)"


def run(*cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        capture: bool = True) -> str:
    done = subprocess.run(cmd, check=False, text=True, env=env, cwd=cwd,
                          stdout=subprocess.PIPE if capture else sys.stderr,
                          stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise SystemExit(f"repo: {' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout or ""


def gpg_env(home: Path) -> dict[str, str]:
    return {**os.environ, "GNUPGHOME": str(home)}


def ensure_key(home: Path) -> str:
    """The fingerprint of the repository's key in `home`, made there the first time."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = gpg_env(home)
    listed = run("gpg", "--batch", "--with-colons", "--list-secret-keys", env=env)
    fprs = [line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:")]
    if fprs:
        return fprs[0]
    run("gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
        "--quick-generate-key", KEY_NAME, "ed25519", "sign", "never", env=env)
    return ensure_key(home)


def publish(repo: Path, home: Path, build_dirs: list[Path]) -> list[str]:
    fpr = ensure_key(home)
    env = gpg_env(home)
    added = []
    for build in build_dirs:
        for dist_dir in sorted(p for p in build.iterdir() if p.is_dir()):
            if dist_dir.name not in _plan.DISTS:
                names = ", ".join(_plan.DISTS)
                raise SystemExit(f"repo: {dist_dir} is no distribution's ({names})")
            pool = repo / "pool/main" / dist_dir.name
            pool.mkdir(parents=True, exist_ok=True)
            for deb in sorted(dist_dir.glob("*.deb")):
                dest = pool / deb.name
                if dest.exists():
                    continue  # a version is published once: the same name is the same build
                tmp = pool / f".{deb.name}.tmp"
                tmp.unlink(missing_ok=True)
                try:
                    os.link(deb, tmp)  # a guest package is 200 MB: linked where it can be
                except OSError:
                    shutil.copy2(deb, tmp)
                (pool / f".{deb.name}.tmp").rename(dest)
                added.append(f"{dist_dir.name}/{deb.name}")
    for dist in _plan.DISTS.values():
        if (repo / "pool/main" / dist.codename).is_dir():
            index(repo, dist, env, fpr)
            link = repo / "dists" / dist.suite
            if not link.is_symlink():
                link.symlink_to(dist.codename)
    (repo / "feos.gpg.tmp").write_bytes(subprocess.run(
        ["gpg", "--batch", "--export", fpr], env=env, check=True,
        stdout=subprocess.PIPE).stdout)
    (repo / "feos.gpg.tmp").rename(repo / "feos.gpg")
    subprocess.run(["gpgconf", "--kill", "all"], env=env, check=False)  # gpg's agent it started
    return added


def index(repo: Path, dist: _plan.Dist, env: dict[str, str], fpr: str) -> None:
    top = repo / "dists" / dist.codename
    binary = top / "main/binary-amd64"
    binary.mkdir(parents=True, exist_ok=True)
    packages = run("apt-ftparchive", "packages", f"pool/main/{dist.codename}", cwd=repo)
    (binary / "Packages").write_text(packages)
    with gzip.open(binary / "Packages.gz", "wt") as f:
        f.write(packages)
    fields = {"Origin": "feos", "Label": "feos", "Suite": dist.suite, "Codename": dist.codename,
              "Architectures": "amd64", "Components": "main",
              "Description": f"feos for Debian ({dist.codename})"}
    opts = [f"-oAPT::FTPArchive::Release::{k}={v}" for k, v in fields.items()]
    release = run("apt-ftparchive", *opts, "release", ".", cwd=top)
    for stale in ("Release", "InRelease", "Release.gpg"):
        (top / stale).unlink(missing_ok=True)
    (top / "Release").write_text(release)
    sign = ["gpg", "--batch", "--yes", "--local-user", fpr, "--digest-algo", "SHA512"]
    run(*sign, "--clearsign", "-o", str(top / "InRelease"), str(top / "Release"), env=env)
    run(*sign, "--detach-sign", "--armor", "-o", str(top / "Release.gpg"), str(top / "Release"),
        env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packaging/deb/repo.py", description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--gnupg-home", type=Path)
    p.add_argument("build_dirs", nargs="+", type=Path)
    args = p.parse_args(argv)
    repo = args.repo.resolve()
    home = (args.gnupg_home or repo.with_name(repo.name + ".key")).resolve()
    if home.is_relative_to(repo):
        raise SystemExit(f"repo: the key's directory {home} must not be inside the repository")
    repo.mkdir(parents=True, exist_ok=True)
    for name in publish(repo, home, args.build_dirs):
        print(f"published {name}")
    print(f"repository {repo} (key {repo / 'feos.gpg'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
