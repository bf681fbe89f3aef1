"""The node's boot: from QEMU's start to feosd answering `host info` over TCP, beside the same
image whose init only imports feosd's main module and prints a marker (rdinit=
/usr/sbin/feos-import-marker). Both under QEMU TCG on a network of the bench's own (kea, radvd,
chrony: integration/hostnet.py), the rounds interleaved; medians.

    flock /tmp/feos-vm.lock env FEOS_VM_LOCK_HELD=1 PYTHONPATH=$PWD .venv/bin/python \
        bench/host_boot.py [--rounds N]

Last line: `ratio to feosd answering / to feosd imported: X (target < 1.5)`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

from _owner import OWNER, exit_on_sigterm  # noqa: E402
from nodevm import NodeVM, node_image  # noqa: E402

MARKER = "FEOS-FEOSD-IMPORTED"
TIMEOUT_S = 900.0
SAID = ("started feosd", "serving the API", "the pods' VMM", "the VMM probe took")


def to_answer(image: Path, work: Path) -> float:
    with NodeVM.boot(image, work) as vm:
        v4 = vm.wait_console(r"DHCPv4: address (\S+)/\d+ on eth0", TIMEOUT_S).group(1)
        seen_v4 = time.monotonic() - vm.started
        serving = None
        attempts: list[tuple[float, float, str]] = []  # start, seconds, how it ended
        while time.monotonic() - vm.started < TIMEOUT_S:
            if serving is None and "serving the API" in vm.console():
                serving = time.monotonic() - vm.started
            began = time.monotonic()
            done = vm.ns("env", f"PYTHONPATH={REPO}", str(REPO / ".venv/bin/python"), "-c",
                         "from feos.cli import main; main()", "--socket", f"{v4}:1337",
                         *vm.tls_flags, "host", "info", timeout=30)
            end = (done.stderr.strip().splitlines() or ["answered"])[-1][:60]
            attempts.append((began - vm.started, time.monotonic() - began,
                             "answered" if done.returncode == 0 else end))
            if done.returncode == 0:
                took = time.monotonic() - vm.started
                serving_at = (f"{serving:.1f} s" if serving is not None else "only after it "
                              "(feosd listens before it logs, and the log is relayed)")
                for line in vm.console().splitlines():  # where feosd's start spent its time
                    if any(w in line for w in SAID):
                        print(f"  console: {line.strip()}", flush=True)
                print(f"  DHCPv4 address seen at {seen_v4:.1f} s, `serving the API` "
                      f"{serving_at}; feosctl attempts: {len(attempts)}, the last three: " + "; ".join(
                          f"at {a:.1f} s {d:.1f} s {e}" for a, d, e in attempts[-3:]),
                      flush=True)
                return took
            time.sleep(0.2)
    raise TimeoutError("feosd did not answer")


def to_import(image: Path, work: Path) -> float:
    with NodeVM.boot(image, work, cmdline=["rdinit=/usr/sbin/feos-import-marker"],
                     setup=lambda s: None) as vm:
        vm.wait_console(re.escape(MARKER), TIMEOUT_S)
        return time.monotonic() - vm.started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="a directory to copy each boot's console to")
    args = ap.parse_args()
    exit_on_sigterm()
    image = node_image()
    answers: list[float] = []
    imports: list[float] = []
    with tempfile.TemporaryDirectory(prefix="feos-host-boot-") as tmp:
        for i in range(args.rounds):
            for name, fn, out in (("imported", to_import, imports), ("answering", to_answer, answers)):
                work = OWNER.directory(Path(tmp) / f"{name}-{i}")
                try:
                    out.append(fn(image, work))
                finally:
                    if args.keep is not None:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(work / "serial.log", args.keep / f"{name}-{i}.log")
                print(f"round {i + 1}: to feosd {name} {out[-1]:.2f} s", flush=True)
    a, b = statistics.median(answers), statistics.median(imports)
    print(f"to feosd imported (median of {args.rounds}): {b:.2f} s")
    print(f"to feosd answering host info over TCP (median of {args.rounds}): {a:.2f} s")
    print(f"ratio to feosd answering / to feosd imported: {a / b:.2f} (target < 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
