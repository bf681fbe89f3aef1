"""feosd as the quickstart runs it, and feosctl as the quickstart drives it (as a user would).

diskd (the disks' daemon, on <state>/disk) is started first, then feosd, each in a session of
its own (a Ctrl-C in the terminal reaches the quickstart, which then stops them in order, feosd
first, not the daemons directly), their output in `<quickstart>/feosd.log` and `diskd.log`. A feosd
already serving on the run directory's socket (one left by a quickstart killed with -9, or started
by hand) is used as it is and left running at the end: it is not this run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from feos.errors import Code, FeosError

BIN = Path(sys.executable).parent
_SERVE_WAIT = 120.0
NOT_FOUND_EXIT = 15  # feosctl's exit code for NOT_FOUND


@attrs.frozen
class Node:
    state_dir: Path
    run_dir: Path
    log: Path

    @property
    def socket(self) -> Path:
        return self.run_dir / "api.sock"


def ctl(node: Node, *argv: str, check: bool = True,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BIN / "feosctl"), "--socket", str(node.socket), *argv],
                          capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise FeosError(Code.UNKNOWN, f"feosctl {' '.join(argv)}: {done.stderr.strip()}")
    return done


def ctl_json(node: Node, *argv: str) -> Any:
    return json.loads(ctl(node, "--json", *argv).stdout)


def serving(node: Node) -> bool:
    return node.socket.exists() and ctl(node, "host", "info", check=False,
                                        timeout=10).returncode == 0


def has_option(name: str) -> bool:
    """Whether this feosd takes `name` (its --help lists it)."""
    done = subprocess.run([str(BIN / "feosd"), "--help"], capture_output=True, text=True,
                          timeout=60)
    return re.search(rf"(^|[\s\[]){re.escape(name)}([\s\]=]|$)", done.stdout, re.M) is not None


def diskd_socket(node: Node) -> Path:
    return node.state_dir / "disk" / "diskd.sock"


def diskd_serving(node: Node) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(diskd_socket(node)))
        except OSError:
            return False
    return True


def start_diskd(node: Node) -> subprocess.Popen[bytes] | None:
    """diskd on <state>/disk, started before feosd (which waits for it where it needs a disk);
    None when one serves there already (it is not this run's and stays)."""
    if diskd_serving(node):
        return None
    program = [str(BIN / "diskd")] if (BIN / "diskd").exists() else \
        [sys.executable, "-m", "feos.disk"]
    argv = [*program, "--state-dir", str(node.state_dir / "disk")]
    node.state_dir.mkdir(parents=True, exist_ok=True)
    with open(node.log.with_name("diskd.log"), "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + _SERVE_WAIT
    while not diskd_serving(node):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise FeosError(Code.UNAVAILABLE, "diskd did not serve: "
                            f"{_tail(node.log.with_name('diskd.log'))}")
        time.sleep(0.1)
    return proc


def start(node: Node, args: list[str]) -> subprocess.Popen[bytes]:
    node.state_dir.mkdir(parents=True, exist_ok=True)
    node.run_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "feosd"), "--state-dir", str(node.state_dir), "--run-dir",
            str(node.run_dir), *args]
    with open(node.log, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_serving(node, proc)
    except BaseException:  # a signal (the quickstart's Stop) too: no feosd left behind
        stop(proc)
        raise
    return proc


def _wait_serving(node: Node, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _SERVE_WAIT
    while not serving(node):
        if proc.poll() is not None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"feosd ended with {proc.returncode}: {_tail(node.log)}")
        if time.monotonic() > deadline:
            raise FeosError(Code.UNAVAILABLE, f"feosd did not serve in {_SERVE_WAIT:.0f} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], timeout: float = 120.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"see {log}"
