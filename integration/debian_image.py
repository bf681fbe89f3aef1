"""A demo image of about 200 MiB built from Debian packages, for bench/disk.py and the bake tests.

Not a test file (integration/ on sys.path imports it). Nothing is downloaded: its one layer is a
Debian rootfs subset, the packages of PACKAGES unpacked from the apt cache (`dpkg-deb -x`), plus
the shared libraries their programs need that the cache lacks, copied from this machine (found
by ldd against the rootfs first); busybox-static's applets give it a shell and dd. It holds
Python 3.11 with numpy, fio and the libraries of fio's engines (ceph's, gluster's: the
bulk of its size), and its command serves HTTP on
SERVE_PORT with Python's http.server: a small server on a large image, as real ones are.

The OCI layout (quickstart's writer and skopeo push, feos.quickstart._image) is built once into
CACHE/<key>/layout, the key a hash of the package files' names and of this module, so a second
run reuses it; `push(registry, prefix)` copies it into a registry (a namespace's, by prefix).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from feos.quickstart._image import blob_file, oci_config, write_image
from feos.quickstart._image import push as push_layout

APT = Path("/var/cache/apt/archives")
CACHE = Path("/var/tmp/feos-debian-image")
REPOSITORY, TAG = "feos/debian-demo", "1"
SERVE_PORT = 8080
PACKAGES = (  # unpacked in order; what they need beyond these comes from this machine
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "python3.11",
    "python3-numpy", "liblapack3", "libblas3", "libgfortran5", "libssl3", "busybox-static",
    "fio", "libaio1", "libgfapi0", "libglusterfs0", "libgfrpc0", "libgfxdr0", "librados2",
    "librbd1", "libpmemblk1", "libpmem1", "libnbd0", "libfmt9", "libboost-thread1.74.0",
    "libibverbs1", "librdmacm1", "liburing2",
)
APPLETS = ("sh", "dd", "cat", "ls", "mkdir", "rm", "sync", "sleep", "echo", "head", "wc", "df")
COMMAND = ["/usr/bin/python3.11", "-m", "http.server", str(SERVE_PORT), "--directory", "/srv"]


def deb(package: str) -> Path:
    found = sorted(APT.glob(f"{package}_*_amd64.deb")) + sorted(APT.glob(f"{package}_*_all.deb"))
    if not found:
        raise FileNotFoundError(f"{package}: no .deb in {APT}")
    return found[-1]


def _key() -> str:
    sha = hashlib.sha256(Path(__file__).read_bytes())
    for package in PACKAGES:
        sha.update(deb(package).name.encode())
    return sha.hexdigest()[:16]


def _unpack(root: Path) -> None:
    for package in PACKAGES:
        subprocess.run(["dpkg-deb", "-x", str(deb(package)), str(root)], check=True)
    for applet in APPLETS:
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (root / "usr/bin/python3").unlink(missing_ok=True)
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "srv").mkdir(exist_ok=True)
    (root / "srv/index.html").write_text("hello from a Debian image served by python3\n")
    (root / "tmp").mkdir(mode=0o1777, exist_ok=True)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")


NEEDED = re.compile(r"^\s*(\S+) => (\S+)", re.M)


def _elves(root: Path) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size > 64:
            with open(path, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.append(path)
    return found


def _libraries(root: Path) -> None:
    """Copy in what the rootfs's ELF files need and only this machine has (libc among them)."""
    dirs = [root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu",
            root / "usr/lib/x86_64-linux-gnu/ceph", root / "usr/lib/x86_64-linux-gnu/blas",
            root / "usr/lib/x86_64-linux-gnu/lapack"]
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(str(d) for d in dirs))
    wanted: set[str] = set()
    for elf in _elves(root):
        done = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, env=env)
        wanted.update(path for _, path in NEEDED.findall(done.stdout)
                      if path.startswith("/") and not path.startswith(str(root)))
    wanted.update({"/lib64/ld-linux-x86-64.so.2"})
    for host in sorted(wanted):
        real = Path(host).resolve()
        for name in {Path(host), real}:
            dest = root / str(name).lstrip("/")
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(real, dest)
    _alternatives(root)


def _alternatives(root: Path) -> None:
    """The BLAS and LAPACK that Debian's alternatives would choose (no update-alternatives here)."""
    lib = root / "usr/lib/x86_64-linux-gnu"
    for name, where in (("libblas.so.3", "blas"), ("liblapack.so.3", "lapack")):
        link = lib / name
        if not link.exists() and (lib / where / name).exists():
            link.symlink_to(f"{where}/{name}")


def _tar(root: Path, out: Path) -> None:
    def fixed(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.iterdir()):
            tar.add(path, arcname=path.name, filter=fixed)


def layout() -> tuple[Path, int]:
    """The image's OCI layout (built if not cached) and its layer's size in bytes."""
    base = CACHE / _key()
    done = base / "layout"
    if not (done / "index.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        root, work = base / "rootfs", base / "layout.tmp"
        root.mkdir(parents=True)
        work.mkdir()
        _unpack(root)
        _libraries(root)
        _tar(root, base / "layer.tar")
        layer = blob_file(work, base / "layer.tar")
        write_image(work, layer, oci_config({"Cmd": COMMAND, "WorkingDir": "/srv",
                                              "Env": ["PATH=/usr/bin:/bin"]}, layer["digest"]),
                    TAG)
        shutil.rmtree(root)
        work.rename(done)
    size = max(p.stat().st_size for p in (done / "blobs/sha256").iterdir())
    return done, size


def push(registry: str, prefix: tuple[str, ...] = ()) -> str:
    """Push the image (built once) to the registry; its reference."""
    where, _ = layout()
    push_layout(where, registry, REPOSITORY, TAG, prefix)
    return f"{registry}/{REPOSITORY}:{TAG}"


if __name__ == "__main__":
    path, size = layout()
    print(f"{path}: layer of {size / 2**20:.0f} MiB")
