"""Hibernation and restore beside their plain counterparts, in one run.

Run as root: flock /tmp/feos-vm.lock .venv/bin/python bench/hibernate.py

Two nodes (integration/podnet.py, each a feosd and its diskd in namespaces of their own) share one
moto S3 server on loopback. The pod: QEMU under TCG, 1 vCPU, 512 MiB, busybox's shell holding a
token and 64 MiB of random bytes in a tmpfs (memory that is not zero, as a working pod's is).

(a) hibernate / raw upload: the hibernation's upload on node A (its events: from `hibernation:
upload` to `hibernation: commit`, the layers and the memory into the store) beside boto3 putting
the same bytes to the same endpoint: the pod is suspended first, and what diskd sends of it (the
4 MiB chunks that are not all zeroes of its memory file and of its disk's top) is copied into
one file, which boto3's upload_file (its default multipart transfer) puts into the bucket; the
pod is resumed, then hibernated.

(b) restore / cold create: `feosctl pod restore` of that checkpoint on node B, up to its answer
(the guest's first Ping answered), beside `feosctl pod create --wait` of the same pod spec under
another ID on node B (a cold boot: the image pulled from B's registry, the container started).

(c) lazy restore / full download restore (Firecracker's test kernel, diskd's memory served
lazily): bench/_lazy_restore.py's `lazy_restore()` answers its two times, or why it was not
measured; its ratio is printed last.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3.s3.transfer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

import _owner  # noqa: E402
from _owner import kept_dir  # noqa: E402
from moto_s3 import MotoS3, moto_s3  # noqa: E402
from podnet import BIN, IMAGE, PodNet  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from _lazy_restore import lazy_restore  # noqa: E402

POD, COLD = "hz0000000aa", "hz0000000bb"
MEMORY_MIB = 512
CHUNK = 4 << 20
LOOP = ("head -c 64M /dev/urandom > /dev/shm/fill 2>/dev/null; "
        "t=$(cat /proc/sys/kernel/random/uuid); n=0; "
        "while :; do n=$((n+1)); echo \"$t $n\" > /tmp/n; sleep 0.2; done")
CREATE = ("--memory", f"{MEMORY_MIB}MiB", "--image", IMAGE, "--cmd", "/bin/sh", "-c", LOOP)
TARGET_UPLOAD, TARGET_RESTORE, TARGET_LAZY = 1.3, 0.5, 0.6


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    began = time.monotonic()
    result = fn(*args)
    return time.monotonic() - began, result


def nonzero_chunks(src: Path, out: Any) -> int:
    """The 4 MiB chunks of src that are not all zeroes (what diskd sends), appended to out."""
    sent = 0
    with open(src, "rb") as f:
        while chunk := f.read(CHUNK):
            if chunk.count(0) != len(chunk):
                out.write(chunk)
                sent += len(chunk)
    return sent


def raw_upload(s3: MotoS3, a: PodNet, root: Path) -> tuple[float, int]:
    """The pod suspended, its bytes gathered, boto3's upload of them timed; the pod resumed."""
    a.ctl_json("pod", "suspend", POD, timeout=600)
    memory = next(a.state_dir.glob(f"vms/*/{POD}/snapshot/memory"))
    top = next((a.feosd.diskd.state_dir / "disks" / POD).glob("top.*"))  # stopped: no path
    staged = root / "raw-upload"
    with open(staged, "wb") as out:
        size = nonzero_chunks(memory, out) + nonzero_chunks(top, out)
    client = s3.client()
    seconds, _ = timed(client.upload_file, str(staged), s3.bucket, "bench/raw-upload",
                       None, None, boto3.s3.transfer.TransferConfig())
    staged.unlink()
    a.ctl_json("pod", "resume", POD, timeout=600)
    return seconds, size


def hibernate(a: PodNet) -> tuple[float, str]:
    """The pod hibernated; the seconds of its upload phase (its events), its checkpoint."""
    events = subprocess.Popen([str(BIN / "feosctl"), "--socket", str(a.feosd.socket), "--json",
                               "pod", "events", POD], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1)  # subscribed
        ref = a.ctl_json("pod", "hibernate", POD, timeout=1200)["checkpoint"]
        time.sleep(0.5)
    finally:
        events.terminate()
    out, _ = events.communicate(timeout=30)
    at = {e.get("reason", ""): e["timeUnixNs"] for e in map(json.loads, out.splitlines())}
    seconds = (at["hibernation: commit"] - at["hibernation: upload"]) / 1e9
    return seconds, ref


def restore_and_cold(b: PodNet, ref: str) -> tuple[float, float]:
    restore_s, restored = timed(b.ctl_json, "pod", "restore", POD, ref)
    assert restored["state"] == "running", restored
    cold_s, cold = timed(b.ctl_json, "pod", "create", COLD, "--wait", *CREATE)
    assert cold["state"] == "running", cold
    return restore_s, cold_s


# -- (c) the lazy restore: uffd's part ---------------------------------------------------------


def main() -> int:
    keep = os.environ.get("FEOS_BENCH_KEEP") == "1"
    print(f"two nodes, one moto S3; QEMU microvm under TCG, 1 vCPU, {MEMORY_MIB} MiB; the pod "
          "holds 64 MiB of random bytes in a tmpfs", flush=True)
    with kept_dir("feos-bench-hibernate-", keep) as tmp:
        root = Path(tmp)
        with contextlib.ExitStack() as stack:
            s3 = stack.enter_context(moto_s3(root))
            a, b = PodNet(root / "a"), PodNet(root / "b")
            for net in (a, b):
                net.feosd.diskd.env.update(s3.env())
                stack.enter_context(net)
            a.ctl_json("pod", "create", POD, "--wait", *CREATE, timeout=600)
            time.sleep(5)  # the container filled its tmpfs
            raw_s, size = raw_upload(s3, a, root)
            print(f"(a) boto3 upload_file of {size / 2**20:.0f} MiB: {raw_s:.2f}s", flush=True)
            upload_s, ref = hibernate(a)
            print(f"(a) the hibernation's upload: {upload_s:.2f}s", flush=True)
            restore_s, cold_s = restore_and_cold(b, ref)
            print(f"(b) restore on node B: {restore_s:.2f}s; cold create: {cold_s:.2f}s",
                  flush=True)
            lazy = lazy_restore(root, s3)
    print(f"ratio hibernate / raw upload: {upload_s / raw_s:.2f} (target < {TARGET_UPLOAD})")
    print(f"ratio restore / cold create: {restore_s / cold_s:.2f} (target < {TARGET_RESTORE})")
    if isinstance(lazy, str):
        print(f"lazy restore: {lazy}")
    else:
        lazy_s, full_s = lazy
        print(f"ratio lazy restore / full download restore: {lazy_s / full_s:.2f} "
              f"(target < {TARGET_LAZY})")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/hibernate.py: run it as root (namespaces, QEMU confined as feosd runs it)")
    sys.exit(_owner.main(main))
