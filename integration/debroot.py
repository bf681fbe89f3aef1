"""Fresh Debian roots booted by systemd-nspawn, systemd as their PID 1, for the packages' tests.

A root per distribution is made once with debootstrap (from Debian's mirror, as apt here is
configured) with what feos's packages depend on from Debian, and cached outside the repo
($FEOS_DEBROOT_CACHE, default /var/cache/feos-debroots): a rerun starts in seconds; a root
cached before DEPENDS grew gets what it lacks installed at its next use. Each test
module boots an overlay of it (the cache is never written), with a private network namespace
(nothing leaves it), the local apt repository bound in read-only and nothing else of ours.
Commands run inside with nsenter into the container's namespaces (this host runs no systemd, so
there is no machinectl).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CACHE = Path(os.environ.get("FEOS_DEBROOT_CACHE", "/var/cache/feos-debroots"))
MIRROR = "http://deb.debian.org/debian"
BASE_INCLUDE = "systemd,systemd-sysv,dbus,python3,iproute2,procps,gpgv,ca-certificates"
# what the packages depend on from Debian, installed into the cached root (the container has no
# network, so its apt finds only feos's repository)
DEPENDS = ("qemu-system-x86 qemu-utils qemu-system-common fuse3 zstd e2fsprogs kmod libnftables1 "
           "nftables iproute2 init-system-helpers python3 libnghttp2-14").split()
BOOT_S = 90.0


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


def base_root(codename: str) -> Path:
    """The cached root of a distribution, made the first time (about 2 minutes)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / f"{codename}-base"
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = root / ".feos-complete"
        if marker.exists():
            if marker.read_text().split() != DEPENDS:  # a cached root from before a new dependency
                _install_depends(root)
                marker.write_text(" ".join(DEPENDS))
            return root
        tmp = CACHE / f"{codename}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _run(["debootstrap", "--variant=minbase", f"--include={BASE_INCLUDE}", codename,
              str(tmp), MIRROR], stdout=subprocess.DEVNULL)
        _install_depends(tmp)
        shutil.rmtree(root, ignore_errors=True)
        (tmp / ".feos-complete").write_text(" ".join(DEPENDS))
        tmp.rename(root)
        return root


def _install_depends(root: Path) -> None:
    """DEPENDS installed into the root from Debian's mirror (those it has already stay)."""
    script = ("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
              f"--no-install-recommends {' '.join(DEPENDS)} && apt-get clean")
    _run(["systemd-nspawn", "-q", "--register=no", "--keep-unit", "-D", str(root), "--pipe",
          "sh", "-c", script], stdout=subprocess.DEVNULL)


class Container:
    """A booted overlay of a cached root; `sh` runs a command inside as root."""

    def __init__(self, name: str, merged: Path, proc: subprocess.Popen[bytes], log: Path):
        self.name, self.merged, self.proc, self.log = name, merged, proc, log
        self.leader = 0

    def find_leader(self) -> int:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid:
                return int(entry.name)
        return 0

    def sh(self, script: str, *, check: bool = True, timeout: float = 300,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
        """sh -c SCRIPT in the container; CompletedProcess with stdout and stderr."""
        done = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "-r", "-w",
             "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
             "DEBIAN_FRONTEND=noninteractive", "sh", "-c", script],
            check=False, text=True, capture_output=True, timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"in {self.name}: {script!r} exited {done.returncode}\n"
                                 f"stdout: {done.stdout}\nstderr: {done.stderr}")
        return done

    def wait_booted(self) -> None:
        deadline = time.monotonic() + BOOT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn ended: {self.log.read_text()[-3000:]}")
            self.leader = self.leader or self.find_leader()
            if self.leader:
                state = self.sh("systemctl is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.5)
        raise AssertionError(f"{self.name} did not boot in {BOOT_S:g}s: "
                             f"{self.log.read_text()[-3000:]}")

    def journal(self, unit: str) -> str:
        return self.sh(f"journalctl -q --no-pager -o cat -u {unit}", check=False).stdout


@contextlib.contextmanager
def booted(codename: str, work: Path, *, binds: dict[str, Path]) -> Iterator[Container]:
    """An overlay of the cached root booted with systemd-nspawn; ended and unmounted after."""
    lower = base_root(codename)
    upper, workdir, merged = work / "upper", work / "work", work / "root"
    for d in (upper, workdir, merged):
        d.mkdir(parents=True)
    _run(["mount", "-t", "overlay", "overlay", "-o",
          f"lowerdir={lower},upperdir={upper},workdir={workdir}", str(merged)])
    name = f"feospkg{os.getpid() % 100000}{codename[:3]}"
    log = work / "nspawn.log"
    proc = None
    try:
        # no Debian mirror inside: the container has no network, apt sees feos's repository only
        for f in ("etc/apt/sources.list", "etc/apt/sources.list.d/debian.sources"):
            (merged / f).unlink(missing_ok=True)
        args = ["systemd-nspawn", "-q", "-D", str(merged), "--boot", "--register=no",
                "--keep-unit", "--private-network", f"--machine={name}", "--console=passive",
                "--bind=/dev/net/tun", "--bind=/dev/fuse", "--capability=all"]
        args += [f"--bind-ro={src}:{dest}" for dest, src in binds.items()]
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        c = Container(name, merged, proc, log)
        c.wait_booted()
        yield c
    finally:
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)  # nspawn: the container's systemd powers off
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for _ in range(50):
            if subprocess.run(["umount", str(merged)], check=False,
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        shutil.rmtree(work, ignore_errors=True)
