"""A pod's disk from diskd beside a plain file, and a pod's containers on a baked layer beside a pull.

Run as root: flock /tmp/feos-vm.lock .venv/bin/python bench/disk.py [--rand-s 20] [--rounds 2]

The node is integration/podnet.py's (feosd in a namespace, Debian's registry in another), with
the demo image of integration/debian_image.py (216 MiB from Debian packages: Python, numpy, fio)
pushed to its registry. QEMU under TCG, 1 vCPU and 512 MiB per microVM.

(a) The disk: fio inside the pod's container, O_DIRECT (`--direct=1`, psync), on a 2 GiB file of
the container's root filesystem (the pod's /data): more than the guest's memory, so neither the
guest's cache nor a read-ahead of it answers. Sequential write and read in 1 MiB blocks (the whole
2 GiB each), then 4 KiB random reads for --rand-s seconds (2 GiB is too much to read 4 KiB at a
time under TCG: the random reads run for a time, over the whole 2 GiB file); each disk gets
--rounds rounds of the three and its best figures count (a shared machine's load). Once on the pod's
disk as feosd gives it (a diskd disk), then on a plain file given to the VMM, today's disk: the
same pod's disk converted to a raw file (`qemu-img convert`, sparse), booted as a bare microVM of the
same spec (feos.vmm's MicroVms in this process) whose guest finds its container on the disk and
starts it again. The copy is taken once the pod has its container and before the diskd half's fio
runs, so that each half writes its fio files into space that was never written. Both halves run on the same host page cache, as the pods would.

(b) The containers phase of a bring-up (the pod's events: the `containers` step to RUNNING:
the pull, the create, the start): a pod on a layer baked of the image (a first pod created with
--bake, its layer pushed to the object store, then a second with --layer) beside the same pod
pulling the image from the registry.

Without diskd on the node (a feosd that says so) part (a)'s first half is a plain file too and
part (b) has no baked layer: the bench says so and prints no ratio for them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

import _owner  # noqa: E402
import debian_image  # noqa: E402
from _owner import OWNER, kept_dir  # noqa: E402
from moto_s3 import moto_s3  # noqa: E402
from podnet import BIN, REGISTRY_PORT, REGISTRY_V4, PodNet  # noqa: E402

from feos.rpc import capnp_thread  # noqa: E402
from feos.vmm._driver import VmSpec  # noqa: E402
from feos.vmm._service import MicroVms  # noqa: E402

MEMORY_MIB = 512
DATA = "2g"  # four times the guest's memory
FILE = "/srv/fio.dat"
TARGET_SEQ, TARGET_RAND, TARGET_BAKED = 0.8, 0.7, 0.3
BAKED_WAIT_S = 900.0  # the push of a 216 MiB layer to the object store under load


def fio_jobs(rand_s: int) -> list[tuple[str, str, list[str]]]:
    """(name, direction in fio's JSON, fio's arguments) of each measurement, in order."""
    common = ["fio", f"--filename={FILE}", f"--size={DATA}", "--direct=1", "--ioengine=psync",
              "--output-format=json", "--name=bench"]
    return [
        ("sequential write", "write", [*common, "--rw=write", "--bs=1m", "--end_fsync=1"]),
        ("sequential read", "read", [*common, "--rw=read", "--bs=1m"]),
        ("4k random read", "read", [*common, "--rw=randread", "--bs=4k", "--norandommap",
                                    f"--runtime={rand_s}", "--time_based"]),
    ]


Exec = Callable[[list[str]], Awaitable[str]]


async def measure(run: Exec, rand_s: int, rounds: int) -> dict[str, float]:
    """Bytes per second of each job, the best of `rounds` (the file removed after each)."""
    got: dict[str, float] = {}
    for i in range(rounds):
        for name, direction, argv in fio_jobs(rand_s):
            result = json.loads(await run(argv))["jobs"][0][direction]
            got[name] = max(got.get(name, 0.0), float(result["bw_bytes"]))
            print(f"    {i + 1}: {name}: {result['bw_bytes'] / 2**20:.1f} MiB/s, "
                  f"{result['iops']:.0f} IOPS", flush=True)
        await run(["rm", "-f", FILE])
    return got


# -- part (a): the pod's disk as feosd gives it, then a plain file of the same disk ------------


def pod_exec(net: PodNet, pod_id: str) -> Exec:
    async def run(argv: list[str]) -> str:
        done = await trio.to_thread.run_sync(
            lambda: net.ctl("pod", "exec", pod_id, "--", *argv, timeout=1800))
        return done.stdout

    return run


def disk_source(net: PodNet, pod_id: str) -> tuple[Path, str, str]:
    """The stopped pod's disk as a file qemu-img reads: (path, format, what it is)."""
    plain = net.state_dir / "disk" / "pods" / f"{pod_id}.img"
    if plain.exists():
        return plain, "raw", "a plain file (no diskd on this node)"
    for top in net.state_dir.rglob(f"disks/{pod_id}/top.qcow2"):
        return top, "qcow2", "a diskd disk (qcow2 top on its layers)"
    raise AssertionError(f"pod {pod_id}: no disk found under {net.state_dir}")


async def _exec_in(client: Any, name: str, argv: list[str]) -> tuple[int, bytes, bytes]:
    process = await client.exec(name, argv)
    result = await process.communicate()
    return result.exit_code, result.stdout, result.stderr


async def plain_file_half(root: Path, raw: Path, rand_s: int, rounds: int
                          ) -> dict[str, float]:
    """The disk as a raw file given to QEMU: a bare microVM of the same spec, its container
    started again from the disk, the same fio jobs."""
    async with capnp_thread() as bridge, trio.open_nursery() as nursery:
        vms = await nursery.start(MicroVms(root / "state", root / "run", bridge).run)
        vm_id = "pf0000000dd"
        await vms.create(vm_id, VmSpec(memory_mib=MEMORY_MIB, data_disk=str(raw)))
        try:
            await vms.start(vm_id)
            guest = await vms.guest(vm_id, within=60)
            await guest.start_container("main")

            async def run(argv: list[str]) -> str:
                code, out, err = await guest.call(_exec_in, guest.client, "main", argv)
                if code:
                    raise AssertionError(f"{argv[0]} exited {code}: {err.decode()[-500:]}")
                return str(out.decode())

            return await measure(run, rand_s, rounds)
        finally:
            await vms.delete(vm_id)
            nursery.cancel_scope.cancel()


# -- part (b): the containers phase ----------------------------------------------------------


def containers_phase(events: list[dict[str, Any]]) -> float:
    """Seconds from the `containers` step to RUNNING in one pod's events."""
    start = next(e["timeUnixNs"] for e in events if e.get("step") == "containers")
    end = next(e["timeUnixNs"] for e in events if e.get("state") == "running")
    return (end - start) / 1e9


async def create(net: PodNet, pod_id: str, image: str, *extra: str) -> tuple[dict[str, Any],
                                                                           float]:
    """feosctl pod create --wait, watching its events: (the pod, its containers phase in s)."""
    feosctl = [str(BIN / "feosctl"), "--socket", str(net.feosd.socket)]
    watch = await trio.lowlevel.open_process([*feosctl, "--json", "pod", "events", pod_id],
                                             stdout=subprocess.PIPE)
    await trio.sleep(1)  # the watcher subscribed
    await trio.to_thread.run_sync(lambda: net.ctl(
        "pod", "create", pod_id, "--wait", "--memory", f"{MEMORY_MIB}MiB", "--image", image,
        *extra, timeout=1800))
    watch.kill()
    assert watch.stdout is not None
    out = b""
    async for chunk in watch.stdout:
        out += chunk
    await watch.wait()
    events = [json.loads(line) for line in out.splitlines()]
    pod = await trio.to_thread.run_sync(net.ctl_json, "pod", "get", pod_id)
    steps = {this.get("step") or this.get("state", ""): (after["timeUnixNs"] - this["timeUnixNs"])
             / 1e9 for this, after in itertools.pairwise(events)}
    print(f"  pod {pod_id} ({pod.get('disk', '')}): " + ", ".join(
        f"{k} {v:.2f}" for k, v in steps.items()), flush=True)
    for line in guest_said(net, pod_id):
        print(f"    {line}", flush=True)
    return pod, containers_phase(events)


GUEST_SAYS = ("feos-guest: pulled ", "feos-guest: container main made in",
              "feos-guest: container main started in")


def guest_said(net: PodNet, pod_id: str) -> list[str]:
    """The guest's own account of its pull, create and start (its console)."""
    log = net.state_dir / "vms" / "qemu" / pod_id / "serial.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if line.startswith(GUEST_SAYS)]


def wait_baked(net: PodNet, pod_id: str) -> str:
    deadline = time.monotonic() + BAKED_WAIT_S
    while time.monotonic() < deadline:
        pod = net.ctl_json("pod", "get", pod_id)
        if pod.get("baked"):
            return str(pod["baked"])
        time.sleep(2)
    raise AssertionError(f"pod {pod_id}: no baked layer in the object store after "
                         f"{BAKED_WAIT_S:g}s (feosd's log: {net.feosd.log})")


def diskd_store(net: PodNet) -> str:
    """Why the node cannot bake ("" when it can): its diskd's object store."""
    done = net.feosd.diskd.ctl("info", check=False)
    if done.returncode:
        return f"diskctl info failed: {done.stderr.strip()}"
    info = json.loads(done.stdout.splitlines()[0])
    store = info.get("store", {})
    return "" if store.get("configured") else store.get("reason", "no object store")


# -- the run -----------------------------------------------------------------------------------


async def bench(net: PodNet, root: Path, image: str, rand_s: int, rounds: int) -> None:
    print("(b) the pod pulling the image, then (a) the disk in it:", flush=True)
    _, pulled_s = await create(net, "pp0000000aa", image)
    # The plain file is taken before the diskd half writes: both halves then write their fio
    # files into space never written, as on a new disk (taken after, the plain file held the
    # diskd half's fio blocks, and its writes were rewrites beside the diskd half's first writes).
    await trio.to_thread.run_sync(net.ctl, "pod", "stop", "pp0000000aa")
    source, fmt, what = disk_source(net, "pp0000000aa")
    raw = root / "plain.img"
    await trio.run_process(["qemu-img", "convert", "-f", fmt, "-O", "raw", str(source),
                            str(raw)])
    await trio.to_thread.run_sync(
        lambda: net.ctl("pod", "start", "pp0000000aa", "--wait", timeout=1800))
    diskd = await measure(pod_exec(net, "pp0000000aa"), rand_s, rounds)
    await trio.to_thread.run_sync(net.ctl, "pod", "delete", "pp0000000aa")
    print(f"(a) the same disk as a plain file ({raw.stat().st_size >> 30} GiB raw, was {what}):",
          flush=True)
    plain = await plain_file_half(root / "bare", raw, rand_s, rounds)
    raw.unlink()

    why = diskd_store(net)
    baked_s = float("nan")
    if not why:
        print("(b) a pod baking the image, then a pod on its layer:", flush=True)
        await create(net, "pb0000000bb", image, "--bake")
        layer = await trio.to_thread.run_sync(wait_baked, net, "pb0000000bb")
        await trio.to_thread.run_sync(net.ctl, "pod", "delete", "pb0000000bb")
        on_layer, baked_s = await create(net, "pk0000000cc", image, "--layer", layer)
        assert on_layer["disk"] == f"layer:{layer}", on_layer["disk"]

    seq = statistics.mean([diskd["sequential write"] / plain["sequential write"],
                           diskd["sequential read"] / plain["sequential read"]])
    rand = diskd["4k random read"] / plain["4k random read"]
    print(f"containers phase: pulled {pulled_s:.2f} s, on the baked layer {baked_s:.2f} s")
    if what.startswith("a plain file"):
        print("no diskd on this node: the first half of (a) was a plain file too, no ratio")
    else:
        print(f"ratio diskd sequential / plain file: {seq:.2f} (target >= {TARGET_SEQ})")
        print(f"ratio diskd 4k random / plain file: {rand:.2f} (target >= {TARGET_RAND})")
    if why:
        print(f"no baked layer ({why}): no ratio for the containers phase")
    else:
        print(f"ratio baked containers phase / pulled containers phase: {baked_s / pulled_s:.2f}"
              f" (target < {TARGET_BAKED})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rand-s", type=int, default=20, help="seconds of 4 KiB random reads")
    ap.add_argument("--rounds", type=int, default=2, help="fio rounds per disk (the best counts)")
    args = ap.parse_args()
    _, size = debian_image.layout()
    print(f"image {debian_image.REPOSITORY}:{debian_image.TAG}, one layer of {size / 2**20:.0f} "
          f"MiB; QEMU microvm, 1 vCPU, {MEMORY_MIB} MiB; fio O_DIRECT on {DATA}", flush=True)
    keep = os.environ.get("FEOS_BENCH_KEEP") == "1"
    with kept_dir("feos-bench-disk-", keep) as tmp:
        root = Path(tmp)
        bare = OWNER.state_dir(root / "bare" / "state")
        try:
            with contextlib.ExitStack() as stack:
                s3 = stack.enter_context(moto_s3(root))
                net = PodNet(root / "net")
                net.feosd.diskd.env.update(s3.env())  # the object store of feosd's diskd
                stack.enter_context(net)
                registry = f"{REGISTRY_V4}:{REGISTRY_PORT}"
                image = debian_image.push(registry, tuple(net.in_inet()))
                trio.run(bench, net, root, image, args.rand_s, args.rounds)
        finally:
            OWNER.done(bare)
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/disk.py: run it as root (namespaces, QEMU confined as feosd runs it)")
    sys.exit(_owner.main(main))
