"""A feosd process for tests: started in temporary directories, driven with feosctl as a user would.

`Feosd(tmp_path).start()` runs `.venv/bin/feosd` with its state and run directories under
tmp_path and waits for its socket; before it, it starts the diskd of that state directory
(<state>/disk, one per state directory, as the README runs them) unless one runs already.
`ctl(...)` runs feosctl against it and returns the completed process; `stop()` sends SIGTERM to
feosd, then to diskd (diskd stops after feosd), and kill -9 after a timeout; `kill()` kill -9s
feosd alone (a crash of feosd: diskd serves on, as it does on a node); `close()` ends both.
Every process it started is ended when the test ends, and at the latest when the run ends
(integration/_owner.py: feosd, diskd, the QEMUs of its state directory and diskd's exports, also
after a SIGTERM of the run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _owner import OWNER, kill_now, terminate
from diskd_proc import DiskdProc

BIN = Path(sys.executable).parent


class Feosd:
    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None,
                 netns: str | None = None) -> None:
        self.root = root
        self.netns = netns  # feosd runs in it (ip netns exec), diskd where the test runs
        self.state_dir = root / "state"
        self.run_dir = root / "run"
        self.socket = self.run_dir / "api.sock"
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "feosd.log"
        self.program = [str(BIN / "feosd")]
        OWNER.state_dir(self.state_dir)  # its microVMs end with the test run at the latest
        OWNER.run_dir(self.run_dir)  # and its mesh's wireguard-go
        self.diskd = DiskdProc(self.state_dir / "disk", env=env, log=root / "diskd.log")

    def command(self) -> list[str]:
        return [*self.program, "--state-dir", str(self.state_dir), "--run-dir", str(self.run_dir),
                *self.args]

    def spawn(self, *, prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start the process without waiting for it to serve."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")
        if prefix is None and self.netns is not None:
            prefix = ["ip", "netns", "exec", self.netns]
        self.proc = OWNER.popen([*(prefix or []), *self.command()], stdout=log,
                                stderr=subprocess.STDOUT, env=self.env)
        log.close()
        return self.proc

    def start(self, timeout: float = 20.0, **kwargs: Any) -> Feosd:
        if self.socket.exists():
            self.socket.unlink()
        self.start_diskd()
        self.spawn(**kwargs)
        self.wait_serving(timeout)
        return self

    def start_diskd(self) -> None:
        """diskd first (feosd waits for it where it needs a disk), unless it runs already."""
        if self.diskd.proc is None or self.diskd.proc.poll() is not None:
            self.diskd.start()

    def wait_serving(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"feosd ended ({self.proc.returncode}):\n{self.log_text()}")
            if self.socket.exists() and self.ctl("host", "info", check=False).returncode == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"feosd did not serve within {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ctl(self, *argv: str, check: bool = True, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "feosctl"), "--socket", str(self.socket), *argv],
                              capture_output=True, text=True, input=input, timeout=timeout)
        if check and done.returncode != 0:
            tail = "\n".join(self.log_text().splitlines()[-40:])
            raise AssertionError(f"feosctl {' '.join(argv)} failed ({done.returncode}): "
                                 f"{done.stderr.strip()}\nfeosd's log, its end:\n{tail}")
        return done

    def ctl_json(self, *argv: str) -> Any:
        return json.loads(self.ctl("--json", *argv).stdout)

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        terminate(self.proc, timeout)
        if self.diskd.proc is not None:
            self.diskd.stop(timeout)
        return self.proc.returncode

    def kill(self) -> None:
        kill_now(self.proc)

    def close(self) -> None:
        self.kill()
        self.diskd.kill()
        OWNER.done(self.run_dir)  # the mesh's wireguard-go, which outlives feosd by design

    def __enter__(self) -> Feosd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def running_pod(node: Any, pod_id: str, *create: str) -> dict[str, Any]:
    """Pod `pod_id` running, whatever an earlier test of the module left of it: made with
    `create` (feosctl pod create's arguments) if there is none, resumed if suspended, started
    if stopped. Tests share a module's microVMs to stay fast, and each still passes alone."""
    got = node.ctl("--json", "pod", "get", pod_id, check=False)
    if got.returncode == 15:  # NOT_FOUND
        return dict(node.ctl_json("pod", "create", pod_id, "--wait", *create))
    pod = json.loads(got.stdout)
    if pod["state"] == "suspended":
        pod = node.ctl_json("pod", "resume", pod_id)
    elif pod["state"] == "stopped":
        pod = node.ctl_json("pod", "start", pod_id, "--wait")
    assert pod["state"] == "running", pod
    return dict(pod)


def records_gone(directory: Path, *names: str, within: float = 10.0) -> bool:
    """Whether the record files `names` (every `*.pb` if none) are gone from directory, waiting
    up to `within` s: a change is answered once it is in the records' journal, and its file is
    written (or removed) by feosd's folder a moment after (feos/records.py)."""
    deadline = time.monotonic() + within
    while True:
        left = [directory / n for n in names] if names else list(directory.glob("*.pb"))
        if not any(path.exists() for path in left):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def end_microvms(state_dir: Path) -> None:
    """Kill the microVMs of a test's feosd (they outlive it by design) and remove their cgroups.

    A test that kills feosd or its QEMUs leaves what a delete would have removed: this does it.
    """
    for pidfile in state_dir.glob("vms/*/*/qemu.pid"):
        try:
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        except (ValueError, ProcessLookupError, OSError):
            pass
    ids = {d.name for d in state_dir.glob("vms/*/*") if d.is_dir()}
    ids |= {p.stem for p in state_dir.glob("pods/*.pb")}
    time.sleep(0.2)
    for cgroup in Path("/sys/fs/cgroup").glob("**/vms/*"):
        if cgroup.name in ids and cgroup.is_dir():
            try:
                cgroup.rmdir()
            except OSError:
                pass
