"""Guest boot: QEMU's start to the first answered Ping over the guest link, beside the floors.

Run as `.venv/bin/python bench/guest_boot.py [--runs 5] [--cmdline WORDS]` (root; the guest
image installed by hack/guest-image, the newest in $FEOS_GUEST_DIR or /usr/lib/feos/guest).

Each round boots the same kernel under the same QEMU microvm (TCG, 1 vCPU, 512 MiB, the root
erofs, a fresh data disk, virtio-rng) three ways, interleaved so that the load of the machine
falls on all alike:
  - the kernel floor: feos.floor=shell, to FEOS-FLOOR-SHELL on the console (the initramfs after
    its modules and the root's mount);
  - the interpreter floor: feos.floor=python, to FEOS-FLOOR-PYTHON (the root's python3 -S -E -c,
    after every mount the agent gets);
  - the guest: a normal boot, to the first Ping the agent answers through feos.guest's
    GuestClient over guest.sock (and, on the way, to its hello line).
The figures are medians; the last line is the ratio of the guest's boot to the interpreter floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

from guestvm import Guest, GuestVM, installed_guest  # noqa: E402

CPU: str | None = None  # QEMU's -cpu; None: the VMM layer's default


def floor(guest: Guest, work: Path, which: str, cmdline: list[str]) -> float:
    with GuestVM.boot(guest, work, floor=which, cmdline=cmdline, timeout=90, cpu=CPU) as vm:
        return vm.wait_console(f"FEOS-FLOOR-{which.upper()}", 90)


async def _ping(vm: GuestVM) -> tuple[float, float]:
    import capnp  # type: ignore[import-untyped]

    from feos.guest._client import GuestClient

    async with capnp.kj_loop():
        client = await GuestClient.connect(str(vm.wait_link(30)), deadline=90)
        hello = time.monotonic() - vm.started
        try:
            await client.ping()
            return hello, time.monotonic() - vm.started
        finally:
            await client.close()


def agent(guest: Guest, work: Path, cmdline: list[str]) -> tuple[float, float]:
    """(seconds to the session's start, seconds to the answered Ping)."""
    with GuestVM.boot(guest, work, cmdline=cmdline, timeout=120, cpu=CPU) as vm:
        try:
            return asyncio.run(_ping(vm))
        except BaseException:
            print(vm.console()[-3000:], file=sys.stderr)
            raise


def hello_only(guest: Guest, work: Path, cmdline: list[str]) -> tuple[float, float]:
    """Without a node-side client: to the hello line alone (both figures are that)."""
    with GuestVM.boot(guest, work, cmdline=cmdline, timeout=120, cpu=CPU) as vm:
        sock = vm.connect_link(30)
        with sock:
            vm.read_line(sock, 90)
        t = time.monotonic() - vm.started
        return t, t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cmdline", default="", help="extra kernel command line words")
    ap.add_argument("--cpu", default=None, help="QEMU's -cpu (default: the microVM layer's)")
    args = ap.parse_args()
    global CPU
    CPU = args.cpu
    guest = installed_guest()
    cmdline = args.cmdline.split()
    try:
        import feos.guest._client  # noqa: F401

        boot, to = agent, "the first answered Ping"
    except ImportError:
        boot, to = hello_only, "the hello line (no node-side client in feos/guest/ yet)"
    print(f"guest {guest.version} ({guest.manifest['kernel']}), QEMU microvm TCG, 1 vCPU, "
          f"512 MiB, -cpu {CPU or 'default'}, {args.runs} rounds, extra cmdline {cmdline or 'none'}")  # fmt: skip
    shell, python, hello, ping = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="guest-boot-") as tmp:
        for i in range(args.runs):
            shell.append(floor(guest, Path(tmp, f"s{i}"), "shell", cmdline))
            python.append(floor(guest, Path(tmp, f"p{i}"), "python", cmdline))
            h, p = boot(guest, Path(tmp, f"a{i}"), cmdline)
            hello.append(h)
            ping.append(p)
            for d in ("s", "p", "a"):
                Path(tmp, f"{d}{i}", "data.img").unlink(missing_ok=True)
            print(f"  round {i + 1}: shell {shell[-1]:.2f} s, python {python[-1]:.2f} s, "
                  f"hello {h:.2f} s, ping {p:.2f} s", flush=True)  # fmt: skip
    med = statistics.median
    print(f"kernel floor (QEMU start to FEOS-FLOOR-SHELL): {med(shell):.2f} s")
    print(f"interpreter floor (QEMU start to FEOS-FLOOR-PYTHON): {med(python):.2f} s")
    print(f"guest boot to the agent's session (hello): {med(hello):.2f} s")
    print(f"guest boot to {to}: {med(ping):.2f} s")
    print(f"ratio guest boot to Ping / interpreter floor: {med(ping) / med(python):.2f} (target 1.3)")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/guest_boot.py: run as root (QEMU opens the guest's files, as feosd does)")
    sys.exit(main())
