"""The node image's initramfs compressed or not: QEMU's start to the kernel's `Run /init` (the
archive loaded, decompressed and unpacked) under TCG, per format. Why hack/host-image ships it
uncompressed (docs/host-init.md).

    flock /tmp/feos-vm.lock env PYTHONPATH=$PWD .venv/bin/python bench/host_initramfs.py \
        [--rounds N] [--formats none,zstd,lz4,gzip,xz]

The node image as hack/host-image builds it; each format made from its initramfs once (zstd -10,
xz -6 with the CRC32 check the kernel reads, lz4 -l -9 the kernel's legacy frame, gzip -6), kept
in CACHE by the initramfs's sha256 for the next run (xz takes over ten minutes for the 411 MB on
this machine's two shared CPUs: not in the default formats). Each
boot: microvm, TCG, 2 vCPUs, 3 GiB, `rdinit=/bin/true` (the kernel stops at once after /init);
the rounds interleaved, medians. Last line: `ratio to /init zstd / uncompressed: X (target >= 1)`
(above 1: the uncompressed archive boots sooner).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

from _owner import OWNER, exit_on_sigterm  # noqa: E402
from nodevm import node_image  # noqa: E402

from feos.vmm._qemu_argv import host_tsc_khz  # noqa: E402

COMPRESS = {
    "none": None,
    "zstd": ["zstd", "-q", "-10", "-T0", "-c"],
    "xz": ["xz", "--check=crc32", "-6", "-T0", "-c"],
    "lz4": ["lz4", "-l", "-9", "-q", "-c"],
    "gzip": ["gzip", "-6", "-c"],
}
TIMEOUT_S = 300.0
CACHE = Path("/var/tmp/feos-host-initramfs")
# microvm has no PIT or HPET to calibrate the TSC against: without the host's frequency the
# kernel stops at `tsc: Marking TSC unstable` (as integration/nodevm.py boots the node)
TSC = [f"tsc_early_khz={khz}"] if (khz := host_tsc_khz()) else []
RUN_INIT = re.compile(r"Run (/\S+) as init process")


def make(initramfs: Path, fmt: str, digest: str) -> Path:
    """The initramfs in the format, made once per initramfs (CACHE/<sha256>/initramfs.<fmt>)."""
    argv = COMPRESS[fmt]
    if argv is None:
        return initramfs
    out = CACHE / digest / f"initramfs.{fmt}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.{os.getpid()}")
    with initramfs.open("rb") as src, part.open("wb") as dst:
        subprocess.run(argv, stdin=src, stdout=dst, check=True)
    part.replace(out)
    return out


def to_init(vmlinux: Path, initrd: Path, work: Path) -> tuple[float, float]:
    """Seconds from QEMU's start to `Run /init` on the console, and the kernel's unpacking
    (`Trying to unpack` to `Freeing initrd memory`, by its own clock)."""
    serial = work / "serial.log"
    argv = ["qemu-system-x86_64", "-M", "microvm,x-option-roms=off", "-accel", "tcg",
            "-cpu", "max", "-smp", "2", "-m", "3072M", "-nodefaults", "-no-user-config",
            "-nographic", "-no-reboot", "-kernel", str(vmlinux), "-initrd", str(initrd),
            "-append", " ".join(["console=ttyS0", "panic=-1", "rdinit=/bin/true", *TSC]),
            "-serial", f"file:{serial}"]
    start = time.monotonic()
    proc = OWNER.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - start < TIMEOUT_S:
            text = serial.read_text(errors="replace") if serial.exists() else ""
            if RUN_INIT.search(text):
                took = time.monotonic() - start
                stamps = [re.search(rf"\[\s*(\d+\.\d+)\] {what}", text)
                          for what in ("Trying to unpack", "Freeing initrd memory")]
                unpack = (float(stamps[1].group(1)) - float(stamps[0].group(1))
                          if stamps[0] and stamps[1] else float("nan"))
                return took, unpack
            if proc.poll() is not None:
                raise RuntimeError(f"QEMU ended before /init:\n{text[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"no `Run ... as init process` within {TIMEOUT_S:.0f} s")
    finally:
        proc.kill()
        proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="none,zstd,lz4,gzip")
    args = ap.parse_args()
    exit_on_sigterm()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in COMPRESS]
    if unknown:
        ap.error(f"--formats: {', '.join(unknown)}: not one of {', '.join(COMPRESS)}")
    if "none" not in formats or "zstd" not in formats:
        ap.error("--formats needs none and zstd (the last line compares them)")
    image = node_image()
    times: dict[str, list[float]] = {f: [] for f in formats}
    unpacks: dict[str, list[float]] = {f: [] for f in formats}
    with tempfile.TemporaryDirectory(prefix="feos-host-initramfs-", dir="/var/tmp") as tmp:
        digest = json.loads((image / "manifest.json").read_text())["files"]["initramfs"]
        files = {f: make(image / "initramfs", f, digest) for f in formats}
        for i in range(args.rounds):
            for f in formats:
                work = Path(tmp) / f"{f}-{i}"
                work.mkdir()
                took, unpack = to_init(image / "vmlinux", files[f], work)
                times[f].append(took)
                unpacks[f].append(unpack)
                print(f"round {i + 1}: {f:5s} {took:6.2f} s to /init (unpacking {unpack:5.2f} s)",
                      flush=True)
        for f in formats:
            size = files[f].stat().st_size / 1e6
            print(f"{f:5s} {size:6.0f} MB: to /init {statistics.median(times[f]):6.2f} s, the "
                  f"kernel unpacking {statistics.median(unpacks[f]):5.2f} s "
                  f"(medians of {args.rounds})")
    ratio = statistics.median(times["zstd"]) / statistics.median(times["none"])
    print(f"ratio to /init zstd / uncompressed: {ratio:.2f} (target >= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
