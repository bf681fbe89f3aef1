"""The microVM layer's suspend and resume beside QEMU's own, and beside a cold boot.

One 512 MiB guest under the QEMU driver (chroot, own user, seccomp, as feosd runs it), median of
five of each, in the same run as its limits:

- suspend: from the call to the snapshot on disk (fsynced) and QEMU ended, beside QEMU's own
  `stop` + `migrate "exec:cat > FILE"` with the bandwidth cap lifted and `quit`, of the same
  guest unconfined (target: under 1.5x);
- resume: from the call to the guest answering Ping (the resume's own, which the call waits
  for), beside QEMU's own `-incoming` to running
  (target: under 1.5x), and beside a cold boot of the same guest to Ping (target: under 0.1x).

Run as root: .venv/bin/python bench/vmm.py [--trace]

--trace logs each resume's steps (feos.vmm at debug: the load, the link's rejoin, cont, and the
guest's ping after it ran, kept session or new) on stderr.
"""

from __future__ import annotations

import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
import _owner
from _owner import OWNER

import feos.rpc
from feos.vmm._driver import VmHandle, VmSpec
from feos.vmm._guestlink import connect_poking
from feos.vmm._qemu import QemuDriver, _spawn
from feos.vmm._qmp import Qmp, connect_qmp
from feos.vmm._service import MicroVms, guest_root, newest_guest

RUNS = int(os.environ.get("RUNS", "5"))
VM = "benchvmaaaa"


def _disk(gdir: Path, path: Path) -> str:
    subprocess.run(["zstd", "-q", "-d", "-f", "--sparse", str(gdir / "data.img.zst"), "-o",
                    str(path)], check=True)  # fmt: skip
    return str(path)


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def ours(root: Path, bridge: Any, gdir: Path) -> dict[str, list[float]]:
    spec = VmSpec(memory_mib=512, data_disk=_disk(gdir, root / "ours.img"))
    out: dict[str, list[float]] = {"suspend": [], "resume": [], "cold": [], "purge": []}
    async with trio.open_nursery() as n:
        vms = await n.start(MicroVms(root / "state", root / "run", bridge).run)
        await vms.create(VM, spec)
        await vms.start(VM)
        await trio.sleep(2)  # the agent's start settles

        async def resume() -> None:
            await vms.resume(VM)  # it returns once the guest answered the link's Ping

        async def cold() -> None:
            await vms.start(VM)
            await (await vms.guest(VM)).ping()

        for _ in range(RUNS):
            out["suspend"].append(await _timed(lambda: vms.suspend(VM, purge_guest=False)))
            out["resume"].append(await _timed(resume))
        out["purge"].append(await _timed(lambda: vms.suspend(VM, purge_guest=True)))
        await resume()
        for _ in range(RUNS):
            await vms.shutdown(VM)
            out["cold"].append(await _timed(cold))
        await vms.delete(VM)
        n.cancel_scope.cancel()
    return out


async def _qmp(path: Path, pid: int) -> Qmp:
    with trio.fail_after(30):
        while True:
            try:
                return await connect_qmp(str(path), within=1)
            except Exception:
                await trio.sleep(0.005)


async def _until(qmp: Qmp, command: str, key: str, done: set[str]) -> str:
    while True:
        value = str((await qmp.execute(command)).get(key))
        if value in done:
            return value
        await trio.sleep(0.002)


async def native(root: Path, bridge: Any, gdir: Path) -> dict[str, list[float]]:
    """QEMU's own suspend and resume of the same guest, unconfined, driven over raw QMP."""
    driver = QemuDriver(root / "native", confine=False)
    spec = VmSpec(memory_mib=512, data_disk=_disk(gdir, root / "native.img"))
    vm = VmHandle(VM, spec, driver.directory(VM), gdir.name, gdir)
    await driver.prepare(vm)
    d = vm.directory
    argv = [a for a in __import__("json").loads((d / "config").read_text())]
    snap = d / "native.mig"
    pid = OWNER.process(await trio.to_thread.run_sync(_spawn, argv, d, None))
    qmp = await _qmp(d / "qmp.sock", pid)
    client = await bridge.call(connect_poking, str(d / "guest.sock"), 60.0)
    await bridge.call(client.ping)
    await bridge.call(client.close)
    await trio.sleep(2)
    out: dict[str, list[float]] = {"suspend": [], "resume": []}
    for _ in range(RUNS):
        start = time.perf_counter()
        await qmp.execute("stop")
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        await qmp.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(snap))}"})
        await _until(qmp, "query-migrate", "status", {"completed", "failed"})
        await qmp.execute("quit")
        await trio.to_thread.run_sync(os.waitpid, pid, 0)
        out["suspend"].append(time.perf_counter() - start)
        qmp.close()
        start = time.perf_counter()
        incoming = [*argv, "-incoming", f"exec:cat {shlex.quote(str(snap))}"]
        OWNER.forget(pid)
        pid = OWNER.process(await trio.to_thread.run_sync(_spawn, incoming, d, None))
        qmp = await _qmp(d / "qmp.sock", pid)
        # The stream keeps the source's run state (stopped first): it loads paused, then cont.
        await _until(qmp, "query-status", "status", {"paused", "running"})
        await qmp.execute("cont")
        out["resume"].append(time.perf_counter() - start)
    await qmp.execute("quit")
    qmp.close()
    await trio.to_thread.run_sync(os.waitpid, pid, 0)
    OWNER.forget(pid)
    return out


def _line(name: str, values: list[float]) -> float:
    med = statistics.median(values)
    print(f"{name:34s} median {med * 1000:8.1f} ms  ({', '.join(f'{v * 1000:.0f}' for v in values)})")
    return med


async def main() -> None:
    if os.geteuid() != 0:
        sys.exit("bench/vmm.py runs QEMU confined (chroot, its own user): run it as root")
    if "--trace" in sys.argv[1:]:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms %(message)s"))
        logging.getLogger("feos.vmm").addHandler(handler)
        logging.getLogger("feos.vmm").setLevel(logging.DEBUG)
    version, gdir = newest_guest(guest_root())
    # Its QEMUs (they outlive their driver by design) end before the directory goes, also when
    # the run fails or is killed by SIGTERM (_owner).
    root = OWNER.directory(Path(tempfile.mkdtemp(prefix="feos-bench-vmm-", dir="/var/tmp")))
    OWNER.state_dir(root / "state")
    try:
        async with feos.rpc.capnp_thread() as bridge:
            o = await ours(root, bridge, gdir)
            q = await native(root, bridge, gdir)
    finally:
        OWNER.close()
    print(f"guest {version}, 512 MiB, 1 vCPU, TCG, median of {RUNS}")
    s = _line("suspend (feosd)", o["suspend"])
    qs = _line("stop + migrate + quit (QEMU)", q["suspend"])
    _line("suspend with the guest purged", o["purge"])
    r = _line("resume to Ping (feosd)", o["resume"])
    qr = _line("-incoming to running (QEMU)", q["resume"])
    c = _line("cold boot to Ping (feosd)", o["cold"])
    print(f"ratio suspend/qemu-migrate {s / qs:.2f} (target < 1.5)")
    print(f"ratio resume/qemu-incoming {r / qr:.2f} (target < 1.5)")
    print(f"ratio resume/cold-boot {r / c:.3f} (target < 0.1)")


if __name__ == "__main__":
    sys.exit(_owner.main(lambda: trio.run(main)))
