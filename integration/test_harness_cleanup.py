"""A harness or benchmark killed by SIGTERM (as `timeout` and CI end a run) leaves nothing behind.

Each case starts one as a subprocess, waits until its helpers run, sends it SIGTERM, and then
looks for what it had: its processes (feosd, the registry, dnsmasq, QEMU, an echo server), its
network namespaces and their mounts, its directories. integration/_owner.py is what ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The podnet harness as bench/pods.py uses it, with one pod running, in a directory of its own.
PODNET = textwrap.dedent("""
    import sys, tempfile, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import _owner
    from _owner import OWNER
    from podnet import IMAGE, PodNet

    def run():
        root = OWNER.directory(Path(tempfile.mkdtemp(prefix="feos-harness-", dir="/var/tmp")))
        with PodNet(root / "net") as net:
            net.ctl("pod", "create", "hc0000000aa", "--wait", "--memory", "256MiB",
                    "--image", IMAGE, "--cmd", "sleep", "600")
            print("READY", root, net.node_ns, net.inet_ns, flush=True)
            while True:
                time.sleep(3600)

    sys.exit(_owner.main(run))
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; whoever it was reparented to reaps it


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return [p for p in found if _alive(p)]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _with(text: str) -> list[int]:
    """The live processes whose command line names `text`."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [p for p in pids if p != os.getpid() and any(text in a for a in _cmdline(p))
            and _alive(p)]


def _terminate(proc: subprocess.Popen[str], within: float = 120) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the harness did not end within {within}s of its SIGTERM") from None


def _netns_pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_podnet_harness_with_a_pod_killed_by_sigterm_leaves_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PODNET, str(REPO / "integration")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()  # the pod runs: every helper is up
        assert ready[:1] == ["READY"], ready
        root, node_ns, inet_ns = ready[1], ready[2], ready[3]
        helpers = {*_netns_pids(node_ns), *_netns_pids(inet_ns), *_with(root)}
        qemus = [p for p in helpers if any("qemu-system" in a for a in _cmdline(p))]
        assert qemus and len(helpers) >= 4, helpers  # QEMU, feosd, the registry, dnsmasq
        assert _terminate(proc) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert [p for p in helpers if _alive(p)] == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert node_ns not in listed and inet_ns not in listed
    mounts = Path("/proc/self/mountinfo").read_text()
    assert node_ns not in mounts and inet_ns not in mounts
    assert not Path(root).exists()
    assert _with(root) == []


def test_a_benchmark_killed_by_sigterm_leaves_nothing() -> None:
    """bench/api.py while it runs feosd and its echo server (no microVM: quick)."""
    proc = subprocess.Popen([sys.executable, str(REPO / "bench/api.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        helpers: list[int] = []
        while len(helpers) < 2:  # feosd and the echo server
            assert time.monotonic() < deadline, "bench/api.py did not start its two servers"
            assert proc.poll() is None, proc.communicate()
            helpers = _children(proc.pid)
            time.sleep(0.05)
        state = next(a for p in helpers for a in _cmdline(p) if a.endswith("/state"))
        assert _terminate(proc, 60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert [p for p in helpers if _alive(p)] == []
    assert not Path(state).parent.exists()  # its temporary directory
