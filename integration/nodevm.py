"""The node image (hack/host-image) booted under QEMU on a network of the test's own (not a test).

    image = node_image()                          # built or reused: its directory
    with NodeVM.boot(image, workdir, servers=...) as vm:
        vm.wait_console("started feosd", timeout=300)

`NodeVM.boot(image, workdir, *, setup=None, cmdline=(), memory_mib=3072, rtc_base=None)` makes a
namespace (feostest-node-*) with a TAP device nt0, calls `setup(Servers)` to start the servers
there (integration/hostnet.py; None: all of them, with prefix delegation), and starts QEMU in
that namespace: microvm, TCG, the image's vmlinux and initramfs, virtio-net on nt0, serial on
serial.log. QEMU runs without -no-reboot: a reboot of the node is a reset, and the node boots
again on the same console. `vm.ns(argv)` runs a program in the namespace (feosctl against the
node over TCP). Whoever boots it holds /tmp/feos-vm.lock while QEMU runs (the machine-wide VM
lock: the suite's tests run under `flock`, and a boot here takes it itself if it can).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from _owner import OWNER
from hostnet import Servers

from feos.vmm._qemu_argv import host_tsc_khz

REPO = Path(__file__).resolve().parent.parent
LOCK = Path("/tmp/feos-vm.lock")
MAC = "52:54:00:fe:05:01"


def node_image() -> Path:
    """The node image's directory, built by hack/host-image or reused (a cache outside the repo)."""
    done = subprocess.run([str(REPO / "hack/host-image")], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"hack/host-image failed: {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


class NodeVM:
    def __init__(self, image: Path, workdir: Path, netns: str, servers: Servers,
                 argv: list[str]) -> None:
        self.image, self.dir, self.netns, self.servers = image, workdir, netns, servers
        self.serial = workdir / "serial.log"
        self._argv = argv
        self._lock_fd: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls_flags: list[str] = []  # feosctl's, for the API on TCP (site_initramfs)
        self.started = 0.0

    @classmethod
    def boot(cls, image: Path, workdir: Path, *, setup: Callable[[Servers], None] | None = None,
             cmdline: Sequence[str] = (), memory_mib: int = 3072,
             rtc_base: str | None = None, tls: bool = True) -> NodeVM:
        netns = OWNER.netns(f"feostest-node-{secrets.token_hex(3)}")
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", netns, "tuntap", "add", "dev", "nt0", "mode", "tap"],
                       check=True)
        servers = Servers(netns, "nt0", workdir)
        servers.address()
        tsc = host_tsc_khz()
        words = ["console=ttyS0", "panic=-1", "reboot=t", *([f"tsc_early_khz={tsc}"] if tsc else []),
                 *cmdline]
        argv = [
            "qemu-system-x86_64", "-M", "microvm,x-option-roms=off", "-accel", "tcg",
            "-cpu", "max", "-smp", "2", "-m", f"{memory_mib}M", "-nodefaults",
            "-no-user-config", "-nographic", "-kernel", str(image / "vmlinux"),
            "-initrd", str(site_initramfs(image, workdir) if tls else image / "initramfs"),
            "-append", " ".join(words),
            "-netdev", "tap,id=n0,ifname=nt0,script=no,downscript=no",
            "-device", f"virtio-net-device,netdev=n0,mac={MAC}",
            "-object", "rng-random,id=rng0,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng0",
            "-serial", f"file:{workdir / 'serial.log'}",
        ]
        if rtc_base is not None:
            argv += ["-rtc", f"base={rtc_base}"]
        vm = cls(image, workdir, netns, servers, argv)
        vm.tls_flags = operator_flags(workdir) if tls else []
        vm.start()
        (setup or (lambda s: (s.dhcp4(), s.dhcp6(pd=True), s.radvd(), s.chrony())))(servers)
        return vm

    def start(self) -> None:
        self._lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:  # a caller under `flock /tmp/feos-vm.lock` holds it already: then we need not
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not os.environ.get("FEOS_VM_LOCK_HELD"):
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        with (self.dir / "qemu.log").open("wb") as log:
            self.started = time.monotonic()
            self.proc = OWNER.popen(["ip", "netns", "exec", self.netns, *self._argv],
                                    stdout=log, stderr=log)

    def console(self) -> str:
        try:
            return self.serial.read_text(errors="replace")
        except OSError:
            return ""

    def wait_console(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        """The first match of the regular expression in the console from offset `after`."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.console(), after)
            if m is not None:
                return m
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"QEMU ended ({self.proc.returncode}) before {pattern!r}:\n"
                                   f"{self.console()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pattern!r} not on the console within {timeout:.0f} s:\n"
                                   f"{self.console()[-4000:]}")
            time.sleep(0.1)

    def ns(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for name in list(self.servers.procs):
            self.servers.stop(name)
        OWNER.done(self.netns)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> NodeVM:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


SERVER_NAME = "feos-node"  # the node's certificate in the site's initramfs


def site_initramfs(image: Path, workdir: Path) -> Path:
    """The image's initramfs with a site's second archive after it, as a PXE boot would load
    both (docs/host-init.md): /etc/feos/tcp-client-ca.pem (an operator CA of the test's, made by
    trustme), the node's certificate and key for SERVER_NAME. The kernel unpacks both archives
    into one root."""
    import trustme

    ca = trustme.CA()
    site = workdir / "site"
    etc = site / "etc" / "feos"
    etc.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(etc / "tcp-client-ca.pem"))
    server = ca.issue_cert(SERVER_NAME)
    server.cert_chain_pems[0].write_to_path(str(etc / "tcp-cert.pem"))
    server.private_key_pem.write_to_path(str(etc / "tcp-key.pem"))
    client = ca.issue_cert("operator@feos.test")
    client.cert_chain_pems[0].write_to_path(str(workdir / "operator.pem"))
    client.private_key_pem.write_to_path(str(workdir / "operator.key"))
    ca.cert_pem.write_to_path(str(workdir / "operator-ca.pem"))
    names = subprocess.run(["find", "etc"], cwd=site, check=True, capture_output=True).stdout
    archive = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=site,
                             input=names, check=True, capture_output=True).stdout
    joined = workdir / "initramfs"
    with (image / "initramfs").open("rb") as src, joined.open("wb") as out:
        while chunk := src.read(1 << 22):
            out.write(chunk)
        out.write(b"\0" * (-out.tell() % 4))  # each archive starts 4-byte aligned
        out.write(archive)
    return joined


def operator_flags(workdir: Path) -> list[str]:
    """feosctl's flags as the operator of site_initramfs's CA."""
    return ["--tls-cert", str(workdir / "operator.pem"), "--tls-key", str(workdir / "operator.key"),
            "--tls-ca", str(workdir / "operator-ca.pem"), "--tls-server-name", SERVER_NAME]
