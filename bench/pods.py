"""A pod's create to RUNNING beside the guest's own boot to its first Ping, one and ten at once.

Run as root: .venv/bin/python bench/pods.py [--runs 5] [--ten-runs 2]

The node is integration/podnet.py's: feosd in a network namespace of its own, a registry of the
busybox image in another. What is timed, under the same QEMU driver (feos.vmm's MicroVms: chroot,
own user, seccomp, TCG here), 1 vCPU and 512 MiB each:

- create to RUNNING: `feosctl pod create ID --wait --image <registry>/feos/busybox:1 --cmd sleep
  600`, from feosctl's start to its exit with the pod RUNNING (what a user waits for: the disk made,
  the TAP, the boot, the attach, the network pushed, the pull, the container made and started);
  the pod's own figure (its record's changedUnixNs - createdUnixNs) is shown beside it;
- the floor: a bare microVM of the same guest, through MicroVms in this process, from `start` to
  the first answered Ping (its data disk made before the clock starts);
- the same ten at once: ten pods created by ten feosctl at the same moment, to the last RUNNING,
  beside ten bare microVMs started at once, to the last Ping.

The rounds alternate floor and pod so the machine's load (two cores, shared) falls on both alike;
the ratios are of medians (the least of each is printed beside them, for a loaded machine).
Each single pod's bring-up is broken down by its events (disk, vm, guest, containers), and by the
guest's own times from its console (g:network, the push of its network in the attach; g:pull,
inside g:create; g:start): docs/pods.md says where the time goes.
- templated: after those rounds, a template of the same shape holding the image (`feosctl template
  warm 1x512+net=<registry>/feos/busybox:1`: its guest pulled it before the snapshot) and the same
  creates restored from it (docs/templates.md; each checks the tag's digest and fetches no blob),
  beside the cold creates above; and
  ten templated creates at once beside ten raw restores at once: one bare microVM booted and
  suspended, its snapshot restored into ten microVMs at once (QEMU's -incoming through MicroVms,
  no pod, no diskd, no network), to the last resumed guest's Ping.
Targets: one pod under 1.3x its guest's boot; ten at once under 1.3x ten bare boots as well: what
a pod adds (TAP, records, the pull from the registry, crun) is per pod and small beside a boot
under TCG, and feosd serialises only its records and table writes, which are milliseconds.
A templated create under 0.2x a cold one (the boot is what it skips), and ten templated at once
under 1.5x ten raw restores (what a pod adds to a restore: the disk, the TAP, the identity, the
pull and the container).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

import _owner  # noqa: E402
from _guests import OwnGuest  # noqa: E402
from _owner import OWNER, kept_dir  # noqa: E402
from podnet import BIN, IMAGE, PodNet  # noqa: E402

from feos.rpc import capnp_thread  # noqa: E402
from feos.vmm._driver import VmSpec  # noqa: E402
from feos.vmm._service import MicroVms, guest_root, newest_guest  # noqa: E402

MEMORY_MIB = 512
TEN = 10
TARGET_ONE = 1.3
TARGET_TEN = 1.3
TARGET_TEMPLATED = 0.2
TARGET_TEN_TEMPLATED = 1.5


# -- the floor: bare microVMs -------------------------------------------------------------------


def plain_disk(root: Path, vm_id: str, gdir: Path) -> Path:
    """A bare microVM's data disk as a plain file (no diskd): the guest's blank data volume
    unpacked once, then a sparse copy per microVM."""
    blank = root / "blank.img"
    if not blank.exists():
        subprocess.run(["zstd", "-q", "-d", "-f", "--sparse", str(gdir / "data.img.zst"), "-o",
                        str(blank)], check=True)
    disk = root / f"{vm_id}.img"
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(blank), str(disk)], check=True)
    return disk


async def bare_boots(root: Path, ids: list[str]) -> float:
    """Start the microVMs at once; seconds from the start to the last one's answered Ping."""
    _, gdir = newest_guest(guest_root())
    async with capnp_thread() as bridge, trio.open_nursery() as nursery:
        vms = await nursery.start(MicroVms(root / "state", root / "run", bridge).run)
        for vm_id in ids:
            disk = await trio.to_thread.run_sync(plain_disk, root, vm_id, gdir)
            await vms.create(vm_id, VmSpec(memory_mib=MEMORY_MIB, data_disk=str(disk)))
        started = time.perf_counter()

        async def boot(vm_id: str) -> None:
            await vms.start(vm_id)
            await (await vms.guest(vm_id, within=30)).ping()

        async with trio.open_nursery() as boots:
            for vm_id in ids:
                boots.start_soon(boot, vm_id)
        took = time.perf_counter() - started
        for vm_id in ids:
            await vms.delete(vm_id)
            (root / "state" / "disk" / "pods" / f"{vm_id}.img").unlink(missing_ok=True)
        nursery.cancel_scope.cancel()
    return took


async def raw_restores(root: Path, ids: list[str]) -> float:
    """One bare microVM booted and suspended, then restored into each of `ids` at once (QEMU's
    `-incoming` of that one snapshot, through MicroVms as the floor's boots are: no pod, no
    diskd, no network, no identity); seconds to the last resumed guest's answered Ping."""
    _, gdir = newest_guest(guest_root())
    source = "rs" + ids[0][2:]
    async with capnp_thread() as bridge, trio.open_nursery() as nursery:
        vms = await nursery.start(MicroVms(root / "state", root / "run", bridge).run)
        disk = await trio.to_thread.run_sync(plain_disk, root, source, gdir)
        await vms.create(source, VmSpec(memory_mib=MEMORY_MIB, data_disk=str(disk)))
        await vms.start(source)
        await (await vms.guest(source, within=30)).ping()
        await vms.suspend(source)
        memory = root / f"{source}.memory"
        vms.snapshot(source).rename(memory)
        for vm_id in ids:
            copy = root / f"{vm_id}.img"
            await trio.run_process(["cp", "--sparse=always", str(disk), str(copy)])
            await vms.create(vm_id, VmSpec(memory_mib=MEMORY_MIB, data_disk=str(copy)))
        started = time.perf_counter()

        async def restore(vm_id: str) -> None:
            await vms.seed(vm_id, memory)
            await vms.resume(vm_id)
            await (await vms.guest(vm_id, within=30)).ping()

        async with trio.open_nursery() as restores:
            for vm_id in ids:
                restores.start_soon(restore, vm_id)
        took = time.perf_counter() - started
        for vm_id in [source, *ids]:
            await vms.delete(vm_id)
            (root / f"{vm_id}.img").unlink(missing_ok=True)
        memory.unlink()
        nursery.cancel_scope.cancel()
    return took


# -- pods --------------------------------------------------------------------------------------


async def create_pods(net: PodNet, ids: list[str], *, check_template: str = ""
                      ) -> tuple[float, list[float], dict[str, float]]:
    """feosctl pod create --wait for each at once: (seconds to the last exit, the pods' own,
    the bring-up's steps of the first pod in seconds, from its events)."""
    feosctl = [str(BIN / "feosctl"), "--socket", str(net.feosd.socket)]
    watch = await trio.lowlevel.open_process([*feosctl, "--json", "pod", "events", ids[0]],
                                             stdout=subprocess.PIPE)
    await trio.sleep(1)  # the watcher subscribed
    started = time.perf_counter()

    async def create(pod_id: str) -> None:
        await trio.run_process([*feosctl, "pod", "create", pod_id, "--wait", "--memory",
                                f"{MEMORY_MIB}MiB", "--image", IMAGE, "--cmd", "sleep", "600"],
                               capture_stdout=True, capture_stderr=True,
                               check=False)  # fmt: skip

    async with trio.open_nursery() as nursery:
        for pod_id in ids:
            nursery.start_soon(create, pod_id)
    took = time.perf_counter() - started
    steps = await _steps(watch)
    steps.update(_guest_steps(net, ids[0]))
    own = []
    for pod_id in ids:
        pod = await trio.to_thread.run_sync(net.ctl_json, "pod", "get", pod_id)
        if pod["state"] != "running":  # the round does not count (a loaded machine: an attach
            print(f"  pod {pod_id} is {pod['state']}: {pod['reason']}", flush=True)  # past 60 s)
            _why(net, pod_id)
            took = math.nan
        elif check_template and pod.get("cameUp") != f"template:{check_template}":
            print(f"  pod {pod_id} came up {pod.get('cameUp')}, not from the template", flush=True)
            took = math.nan
        own.append((pod["changedUnixNs"] - pod["createdUnixNs"]) / 1e9)
    if os.environ.get("FEOS_BENCH_KEEP") == "1":  # the guests' consoles, before the deletes
        kept = net.state_dir.parent / "serial"
        kept.mkdir(exist_ok=True)
        for pod_id in ids:
            log = net.state_dir / "vms" / "qemu" / pod_id / "serial.log"
            if log.exists():
                shutil.copy(log, kept / f"{pod_id}.log")
    for pod_id in ids:
        await trio.to_thread.run_sync(net.ctl, "pod", "delete", pod_id)
    return took, own, steps


def _why(net: PodNet, pod_id: str) -> None:
    """What feosd and the pod's guest said about a pod that did not come up."""
    said = [line for line in net.feosd.log.read_text(errors="replace").splitlines()
            if pod_id in line and (" WARNING " in line or " ERROR " in line)]  # fmt: skip
    serial = net.state_dir / "vms" / "qemu" / pod_id / "serial.log"
    guest = [line for line in serial.read_text(errors="replace").splitlines()
             if line.startswith("feos-guest:")] if serial.exists() else []  # fmt: skip
    for line in said[-5:] + guest[-12:]:
        print(f"    {line[:300]}", flush=True)


async def _steps(watch: trio.Process) -> dict[str, float]:
    """Seconds from each event of the bring-up to the next: disk, vm, guest, volumes+containers."""
    watch.kill()
    assert watch.stdout is not None
    out = b""
    async for chunk in watch.stdout:
        out += chunk
    await watch.wait()
    events = [json.loads(line) for line in out.splitlines()]
    steps: dict[str, float] = {}
    for this, after in itertools.pairwise(events):
        name = this.get("step") or this.get("state", "")
        steps[name] = steps.get(name, 0.0) + (after["timeUnixNs"] - this["timeUnixNs"]) / 1e9
    return steps


GUEST_LINES = (  # the guest's console (feos.guest._service, _images, _containers): name, pattern
    ("g:network", re.compile(r"configureNetwork took ([\d.]+) s")),
    ("g:pull", re.compile(r"pulled \S+ in ([\d.]+) s")),
    ("g:create", re.compile(r"container \S+ made in ([\d.]+) s")),
    ("g:start", re.compile(r"container \S+ started in ([\d.]+) s")),
)


def _guest_steps(net: PodNet, pod_id: str) -> dict[str, float]:
    """The guest's own times of its parts of the bring-up, from its console (serial.log)."""
    log = net.state_dir / "vms" / "qemu" / pod_id / "serial.log"
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    found = {}
    for name, pattern in GUEST_LINES:
        match = pattern.search(text)
        if match:
            found[name] = float(match.group(1))
    return found


# -- the run -------------------------------------------------------------------------------------


async def bench(net: PodNet, root: Path, runs: int, ten_runs: int) -> None:
    pods, own, bare = [], [], []
    for i in range(runs):
        bare.append(await bare_boots(root / "bare", [f"bx{i:09d}"]))
        took, mine, steps = await create_pods(net, [f"pz{i:09d}"])
        pods.append(took)
        own += mine
        print(f"  round {i + 1}: bare boot to Ping {bare[-1]:.2f} s, pod create to RUNNING "
              f"{took:.2f} s (feosd's own {mine[0]:.2f} s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + ")", flush=True)
    ten_bare, ten_pods = [], []
    for i in range(ten_runs):
        ten_bare.append(await bare_boots(root / "bare", [f"bt{i}{j:08d}" for j in range(TEN)]))
        took, ten_own, _ = await create_pods(net, [f"pt{i}{j:08d}" for j in range(TEN)])
        ten_pods.append(took)
        print(f"  ten at once, round {i + 1}: bare boots {ten_bare[-1]:.2f} s, pods "
              f"{took:.2f} s (feosd's own, slowest {max(ten_own):.2f} s)", flush=True)
    templated, ten_templated, ten_raw = await templated_rounds(net, root, runs, ten_runs)

    def med(values: list[float]) -> float:
        return statistics.median([v for v in values if not math.isnan(v)] or [math.nan])

    print(f"guest boot to Ping (bare microVM, MicroVms): median {med(bare):.2f} s, "
          f"least {_least(bare):.2f} s")
    print(f"pod create to RUNNING (feosctl --wait): median {med(pods):.2f} s, "
          f"least {_least(pods):.2f} s; feosd's own median {med(own):.2f} s")
    print(f"ten bare boots at once: median {med(ten_bare):.2f} s; "
          f"ten pods at once: median {med(ten_pods):.2f} s")
    print(f"(the least of each: one {_least(pods) / _least(bare):.2f}, "
          f"ten {_least(ten_pods) / _least(ten_bare):.2f})")
    print(f"ratio create to RUNNING / guest boot to Ping: {med(pods) / med(bare):.2f} "
          f"(target < {TARGET_ONE})")
    print(f"ratio ten pods at once / ten bare boots at once: {med(ten_pods) / med(ten_bare):.2f} "
          f"(target < {TARGET_TEN})")
    print(f"templated create to RUNNING: median {med(templated):.2f} s (cold {med(pods):.2f} s);"
          f" ten templated at once {med(ten_templated):.2f} s, ten raw restores at once "
          f"{med(ten_raw):.2f} s")
    print(f"ratio templated create / cold create: {med(templated) / med(pods):.2f} "
          f"(target < {TARGET_TEMPLATED})")
    print(f"ratio ten templated at once / ten raw restores at once: "
          f"{med(ten_templated) / med(ten_raw):.2f} (target < {TARGET_TEN_TEMPLATED})")


async def templated_rounds(net: PodNet, root: Path, runs: int,
                           ten_runs: int) -> tuple[list[float], list[float], list[float]]:
    """The same creates from a template of their shape (made now, after the cold rounds), and
    ten at once beside ten raw restores at once."""
    made = await trio.to_thread.run_sync(
        lambda: net.ctl_json("template", "warm", f"1x{MEMORY_MIB}+net={IMAGE}", timeout=300))
    print(f"  template {made['name']} holding {made['heldImage']}: "
          f"{made['memoryBytes'] >> 20} MiB of memory", flush=True)
    templated: list[float] = []
    for i in range(runs):
        took, mine, steps = await create_pods(net, [f"pq{i:09d}"], check_template=made["name"])
        templated.append(took)
        print(f"  templated round {i + 1}: create to RUNNING {took:.2f} s (feosd's own "
              f"{mine[0]:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + ")",
              flush=True)
    ten_templated, ten_raw = [], []
    for i in range(ten_runs):
        ten_raw.append(await raw_restores(root / "bare", [f"rr{i}{j:08d}" for j in range(TEN)]))
        took, _, _ = await create_pods(net, [f"pr{i}{j:08d}" for j in range(TEN)],
                                       check_template=made["name"])
        ten_templated.append(took)
        print(f"  ten at once, round {i + 1}: raw restores {ten_raw[-1]:.2f} s, templated pods "
              f"{took:.2f} s", flush=True)
    return templated, ten_templated, ten_raw


def _least(values: list[float]) -> float:
    return min((v for v in values if not math.isnan(v)), default=math.nan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ten-runs", type=int, default=2, help="rounds of ten at once (default 2)")
    args = ap.parse_args()
    keep = os.environ.get("FEOS_BENCH_KEEP") == "1"  # the node's and guests' logs stay, to read
    with kept_dir("feos-bench-pods-", keep) as tmp:
        guest = OwnGuest(Path(tmp)).install()  # this tree's agent (templates need its assume)
        try:
            return _run(args, Path(tmp))
        finally:
            guest.restore()


def _run(args: argparse.Namespace, root: Path) -> int:
    version, _ = newest_guest(guest_root())
    print(f"guest {version}, QEMU microvm ({os.cpu_count()} cores), 1 vCPU, {MEMORY_MIB} MiB "
          f"each, median of {args.runs}; image {IMAGE}")
    bare = OWNER.state_dir(root / "bare" / "state")  # the floor's microVMs outlive MicroVms
    try:
        with PodNet(root / "net") as net:
            info = json.loads(net.ctl("--json", "host", "info").stdout)
            accel = info.get("version", {}).get("accel", "?")
            print(f"accelerator {accel}", flush=True)
            trio.run(bench, net, root, args.runs, args.ten_runs)
    finally:
        OWNER.done(bare)  # before the directory goes
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/pods.py: run it as root (namespaces, QEMU confined as feosd runs it)")
    sys.exit(_owner.main(main))  # a SIGTERM (timeout's) ends it with its cleanups
