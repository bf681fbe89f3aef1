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
`--guest VERSION` (repeatable) picks installed versions instead of the newest: with two or more,
each round boots the agent of every one of them after the floors (those of the first), so that
two builds of the agent are compared under the same load; the last line is the first's ratio.

`--imports` boots feos.floor=script instead, with a program that imports the agent
(feos.guest.__main__, as the launcher does) under the root's python3 -S -E -X importtime and
prints the seconds that took: the report is their median and the modules that cost most (median
self and cumulative microseconds under TCG). `--script FILE` runs a program of your own the same
way (on drive vol1; sys.path as the launcher's), and prints its output from each round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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

    from feos.guestlink import GuestClient

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
            took = asyncio.run(_ping(vm))
        except BaseException:
            print(vm.console()[-3000:], file=sys.stderr)
            raise
        print(f"    in the guest (its clock): {_agent_clock(vm.console())}")
        return took


def _agent_clock(console: str) -> str:
    """The agent's own times: its start (imports done) and its first hello, since the boot."""
    found = re.search(r"starting \(pid \d+, at ([0-9.]+) s(?:, python at ([0-9.]+) s)?\)", console)
    hello = re.search(r"hello sent \(at ([0-9.]+) s\)", console)
    if not (found and hello):
        return "no times on the console"
    start, sent = float(found[1]), float(hello[1])
    ready = f"python ready {float(found[2]):.3f} s, " if found[2] else ""
    init = re.search(r"starting the agent \(at ([0-9.]+) s\)", console)
    if init:  # /init's exec of the agent (/proc/uptime: to 10 ms)
        ready = f"exec {float(init[1]):.2f} s, {ready}"
    return f"{ready}agent started {start:.3f} s, hello sent {sent:.3f} s (+{sent - start:.3f})"


def hello_only(guest: Guest, work: Path, cmdline: list[str]) -> tuple[float, float]:
    """Without a node-side client: to the hello line alone (both figures are that)."""
    with GuestVM.boot(guest, work, cmdline=cmdline, timeout=120, cpu=CPU) as vm:
        sock = vm.connect_link(30)
        with sock:
            vm.read_line(sock, 90)
        t = time.monotonic() - vm.started
        return t, t


IMPORTS = b"""
import time
t = time.monotonic()
import feos.guest.__main__
print("FEOS-SCRIPT-IMPORTS %.3f" % (time.monotonic() - t), flush=True)
"""
Table = dict[str, tuple[int, int]]  # module: (self us, cumulative us), as -X importtime says


def script(guest: Guest, work: Path, program: bytes, cmdline: list[str]) -> tuple[str, Table]:
    """Run a Python program in the guest (feos.floor=script): (its stdout, its import times)."""
    work.mkdir(parents=True, exist_ok=True)
    vol = work / "program.img"
    vol.write_bytes(program + b"\0" * (-len(program) % 512 or 512))
    with GuestVM.boot(
        guest, work, floor="script", volumes=[vol], cmdline=cmdline, timeout=120, cpu=CPU
    ) as vm:
        vm.wait_console("FEOS-SCRIPT-END", 120)
        text = vm.console()
    out, _, err = text.partition("FEOS-SCRIPT-STDERR")
    out = out.rpartition("FEOS-INIT: data disk")[2].partition("\n")[2]
    table: Table = {}
    for line in err.partition("FEOS-SCRIPT-END")[0].splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            table[parts[2].strip()] = (int(parts[0]), int(parts[1]))
        elif line.strip() and not line.startswith("import time:"):
            out += line + "\n"  # a traceback, say
    return out, table


def main_script(guest: Guest, program: bytes, runs: int, cmdline: list[str]) -> int:
    """Each round's output, then the imports that cost most (median of the rounds)."""
    took: list[float] = []
    tables: list[Table] = []
    with tempfile.TemporaryDirectory(prefix="guest-script-") as tmp:
        for i in range(runs):
            out, table = script(guest, Path(tmp, f"x{i}"), program, cmdline)
            Path(tmp, f"x{i}", "data.img").unlink(missing_ok=True)
            tables.append(table)
            print(f"  round {i + 1}: {len(table)} modules imported")
            for line in out.strip().splitlines():
                print(f"    {line.rstrip()}")
                if line.startswith("FEOS-SCRIPT-IMPORTS "):
                    took.append(float(line.split()[1]))
    med = statistics.median
    names = set().union(*tables)
    rows = {n: (med([t.get(n, (0, 0))[0] for t in tables]),
                med([t.get(n, (0, 0))[1] for t in tables])) for n in names}  # fmt: skip
    for title, key in (("cumulative", 1), ("self", 0)):
        print(f"imports by {title} time (median us of {runs} rounds; self, cumulative):")
        for name, (own, cum) in sorted(rows.items(), key=lambda r: -r[1][key])[:25]:
            print(f"  {own:9.0f} {cum:9.0f}  {name}")
    if took:
        print(f"the agent's imports in the guest (-X importtime on): {med(took):.3f} s, "
              f"{len(names)} modules")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cmdline", default="", help="extra kernel command line words")
    ap.add_argument("--cpu", default=None, help="QEMU's -cpu (default: the microVM layer's)")
    ap.add_argument("--guest", action="append", default=[], metavar="VERSION",
                    help="an installed guest version (repeat to interleave the agents of several)")
    ap.add_argument(
        "--imports",
        action="store_true",
        help="time the agent's imports in the guest instead (feos.floor=script)",
    )
    ap.add_argument(
        "--script",
        type=Path,
        default=None,
        help="run this Python program in the guest instead (feos.floor=script)",
    )
    args = ap.parse_args()
    global CPU
    CPU = args.cpu
    guests = [installed_guest(v) for v in args.guest] or [installed_guest()]
    guest = guests[0]
    cmdline = args.cmdline.split()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.imports or args.script:
        program = args.script.read_bytes() if args.script else IMPORTS
        print(f"guest {guest.version}: {args.script or 'the agent imports'}, {args.runs} rounds")
        return main_script(guest, program, args.runs, cmdline)
    try:
        import feos.guestlink  # noqa: F401

        boot, to = agent, "the first answered Ping"
    except ImportError:
        boot, to = hello_only, "the hello line (no node-side client, feos.guestlink, yet)"
    print(f"guest {guest.version} ({guest.manifest['kernel']}), QEMU microvm TCG, 1 vCPU, "
          f"512 MiB, -cpu {CPU or 'default'}, {args.runs} rounds, extra cmdline {cmdline or 'none'}")  # fmt: skip
    shell: list[float] = []
    python: list[float] = []
    hello: dict[str, list[float]] = {g.version: [] for g in guests}
    ping: dict[str, list[float]] = {g.version: [] for g in guests}
    with tempfile.TemporaryDirectory(prefix="guest-boot-") as tmp:
        for i in range(args.runs):
            shell.append(floor(guest, Path(tmp, f"s{i}"), "shell", cmdline))
            python.append(floor(guest, Path(tmp, f"p{i}"), "python", cmdline))
            line = f"  round {i + 1}: shell {shell[-1]:.2f} s, python {python[-1]:.2f} s"
            for g in guests:
                h, p = boot(g, Path(tmp, f"a{i}-{g.version}"), cmdline)
                hello[g.version].append(h)
                ping[g.version].append(p)
                line += f", {g.version if len(guests) > 1 else ''} hello {h:.2f} s, ping {p:.2f} s"
            for d in Path(tmp).iterdir():
                (d / "data.img").unlink(missing_ok=True)
            print(line.replace(",  hello", ", hello"), flush=True)
    med = statistics.median
    print(f"kernel floor (QEMU start to FEOS-FLOOR-SHELL): {med(shell):.2f} s")
    print(f"interpreter floor (QEMU start to FEOS-FLOOR-PYTHON): {med(python):.2f} s")
    for g in reversed(guests):  # the first's figures last, next to its ratio
        of = f" ({g.version})" if len(guests) > 1 else ""
        print(f"guest boot to the agent's session (hello){of}: {med(hello[g.version]):.2f} s")
        print(f"guest boot to {to}{of}: {med(ping[g.version]):.2f} s")
        if g is not guest:
            print(f"  ratio{of}: {med(ping[g.version]) / med(python):.2f} (target < 1.3)")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ratio = med(ping[guest.version]) / med(python)
    print(f"ratio guest boot to Ping / interpreter floor: {ratio:.2f} (target < 1.3)")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/guest_boot.py: run as root (QEMU opens the guest's files, as feosd does)")
    sys.exit(main())
