"""exec as docker exec, in one real QEMU pod: the container's working directory and environment
(the image's and the spec's), -w and -e over them, -t's terminal at the caller's size with the
caller's terminal given back, and --wait's bring-up steps as lines, in order.

The pod's container is podnet's busybox (its image sets FROM_IMAGE=yes and WorkingDir /), with
the spec's FROM_SPEC=spec and workingDir /tmp.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Iterator

import pytest
from feosd_proc import BIN
from podnet import IMAGE, PodNet

POD = "px00000001a"
SPEC = {"memoryMib": 256, "containers": [{
    "name": "main", "image": IMAGE, "command": ["/bin/sleep", "600"],
    "env": [{"key": "FROM_SPEC", "value": "spec"}], "workingDir": "/tmp"}]}  # fmt: skip
SHOW = ("sh", "-c", "pwd; echo $FROM_IMAGE $FROM_SPEC")
STEP = re.compile(rf"pod {POD}: (\S+?):? .*\(\d+\.\ds\)\Z")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodNet]:
    with PodNet(tmp_path_factory.mktemp("podexec")) as node:
        yield node


@pytest.fixture(scope="module")
def created(net: PodNet) -> list[str]:
    done = net.ctl("pod", "create", POD, "-f", net.spec_file("exec", SPEC), "--wait")
    return [m[1] for line in done.stderr.splitlines() if (m := STEP.match(line.strip()))]


def test_wait_shows_the_bring_up_steps_in_order(created: list[str]) -> None:
    # Each step once, in the bring-up's order; the first may have passed before the watch.
    order = ["disk", "vm", "guest", "volumes", "containers"]
    assert created[-1] == "running", created
    steps = created[:-1]
    assert steps == order[len(order) - len(steps):] and len(steps) >= 3, created


def test_exec_runs_in_the_containers_directory_with_its_environment(
    net: PodNet, created: list[str]
) -> None:
    assert net.exec(POD, *SHOW).stdout == "/tmp\nyes spec\n"


def test_w_and_e_override(net: PodNet, created: list[str]) -> None:
    got = net.ctl("pod", "exec", POD, "-w", "/proc", "-e", "FROM_SPEC=call", "-e",
                  "FROM_IMAGE=no", "--", *SHOW)  # fmt: skip
    assert got.stdout == "/proc\nno call\n"


def test_t_gives_a_terminal_of_the_callers_size(net: PodNet, created: list[str]) -> None:
    script = "test -t 0 && test -t 1 && echo tty-yes; busybox stty size"
    out = _on_a_terminal(net, ["-t", "--", "sh", "-c", script], b"")
    assert b"tty-yes\r\n" in out and b"33 101\r\n" in out, out


def test_it_is_a_shell_that_reads_the_keys(net: PodNet, created: list[str]) -> None:
    out = _on_a_terminal(net, ["-it", "--", "sh"], b"echo typed-$((1+2))\rexit 0\r")
    assert b"typed-3" in out, out


def _on_a_terminal(net: PodNet, argv: list[str], keys: bytes) -> bytes:
    """feosctl pod exec on a terminal of 33 x 101 of the test's (a pty), keys typed into it;
    its output, once feosctl has ended with 0 and given the terminal back as it was."""
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
        before = termios.tcgetattr(slave)
        with subprocess.Popen(
            [str(BIN / "feosctl"), "--socket", str(net.feosd.socket), "pod", "exec", POD, *argv],
            stdin=slave, stdout=slave, stderr=subprocess.PIPE,
        ) as proc:  # fmt: skip
            if keys:
                os.write(master, keys)
            out = _read_until_exit(master, proc)
            err = proc.stderr.read() if proc.stderr else b""
        assert proc.returncode == 0, (out, err)
        assert termios.tcgetattr(slave) == before  # raw mode given back
    finally:
        os.close(master)
        os.close(slave)
    return out


def test_without_t_no_terminal(net: PodNet, created: list[str]) -> None:
    got = net.exec(POD, "sh", "-c", "test -t 0 || echo no-tty")
    assert got.stdout == "no-tty\n"


def _read_until_exit(master: int, proc: subprocess.Popen[bytes]) -> bytes:
    out = bytearray()
    os.set_blocking(master, False)
    deadline = time.monotonic() + 120  # a bound on a broken run, not a synchronisation
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                out += os.read(master, 65536)
            except OSError:
                break
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)
    return bytes(out)
