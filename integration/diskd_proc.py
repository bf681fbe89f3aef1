"""A diskd process for tests: started on a state directory under the test's tmp_path.

`DiskdProc(state_dir).start()` runs diskd (`python -m feos.disk`, as the `diskd` entry point
does) and waits for its socket to answer; `call(method, **params)` calls its API as feosd does
(feos.disk.DiskdConnection), `ctl(...)` runs diskctl; `stop()` sends SIGTERM, `kill()` kill -9.
What it started ends with the test run at the latest (integration/_owner.py), its exports
(qemu-storage-daemon, which outlive diskd by design) and their FUSE mounts included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import capnp
from _owner import OWNER, kill_now, terminate

from feos.disk import DiskdConnection

CTL = "import sys; from feos.disk import ctl; sys.argv[0] = 'diskctl'; ctl()"


class DiskdProc:
    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.state_dir = state_dir
        self.socket = state_dir / "diskd.sock"
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.log = log or state_dir.parent / f"{state_dir.name}-diskd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        OWNER.disk_state(state_dir)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "feos.disk", "--state-dir", str(self.state_dir), *self.args]

    def spawn(self) -> subprocess.Popen[bytes]:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = OWNER.popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env)
        return self.proc

    def start(self, timeout: float = 20.0) -> DiskdProc:
        self.spawn()
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"diskd ended ({self.proc.returncode}):\n{self.log_text()}")
            if self.socket.exists() and self.ctl("info", check=False).returncode == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"diskd did not serve within {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ctl(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-c", CTL, "--socket", str(self.socket), *argv],
                              capture_output=True, text=True, timeout=60, env=self.env)
        if check and done.returncode != 0:
            raise AssertionError(f"diskctl {' '.join(argv)} failed ({done.returncode}): "
                                 f"{done.stderr.strip()}")
        return done

    def ctl_json(self, *argv: str) -> Any:
        return [json.loads(line) for line in self.ctl(*argv).stdout.splitlines()]

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One API call, as feosd makes it; FeosError for a status other than ok."""

        async def once() -> dict[str, Any]:
            connection = await DiskdConnection.connect(str(self.socket))
            try:
                return await connection.call(method, **params)
            finally:
                connection.close()

        return asyncio.run(capnp.run(once()))

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return terminate(self.proc, timeout)

    def kill(self) -> None:
        kill_now(self.proc)

    def __enter__(self) -> DiskdProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        end_exports(self.state_dir)


def end_exports(root: Path) -> None:
    """The FUSE exports left below `root` ended: their daemons outlive diskd by design, so a test
    that leaves a disk started (or fails before it stops it) would leave a daemon, or its mount
    once the daemon is killed, behind. SIGTERM makes qemu-storage-daemon unmount its export; a
    mount still there is detached."""
    for pid in exports_under(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _fuse_mounts(root):
        time.sleep(0.05)
    for mount in _fuse_mounts(root):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)


def exports_under(root: Path) -> list[int]:
    """The qemu-storage-daemon processes serving a disk below root."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if words[0].endswith(b"qemu-storage-daemon") and str(root).encode() in b" ".join(words):
            found.append(int(cmdline.parent.name))
    return found


def _fuse_mounts(root: Path) -> list[str]:
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].encode().decode("unicode_escape")  # spaces come octal-escaped
        if fields[2].startswith("fuse") and point.startswith(str(root)):
            found.append(point)
    return found
