"""feosd's own behaviour as a process: the lock, the socket, readiness, faults, stop and upgrade."""

from __future__ import annotations

import grp
import os
import random
import signal
import socket
import stat
import subprocess
import threading
import time
import uuid

import pytest

from feos.errors import Code, FeosError


def test_sigterm_ends_it_cleanly(feosd) -> None:  # type: ignore[no-untyped-def]
    assert feosd.stop() == 0
    assert "SIGTERM: stopping" in feosd.log_text()


def test_the_lock_holds_a_second_feosd_waiting(feosd_factory) -> None:  # type: ignore[no-untyped-def]
    first = feosd_factory().start()
    lock = first.state_dir / "feosd.lock"
    assert lock.read_text().strip() == str(first.proc.pid)

    second = feosd_factory(root="node")  # the same directories
    second.run_dir = first.root / "run2"
    second.socket = second.run_dir / "api.sock"
    second.log = first.root / "second.log"
    second.spawn()
    deadline = time.monotonic() + 10
    while "holds" not in second.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"another feosd (pid {first.proc.pid}) holds {lock}" in second.log_text()
    time.sleep(1.5)  # it keeps trying, never exits
    assert second.proc.poll() is None
    assert not second.socket.exists()

    first.stop()
    second.wait_serving(10)
    assert lock.read_text().strip() == str(second.proc.pid)
    assert second.stop() == 0


def test_the_socket_is_private_without_a_feos_group(feosd) -> None:  # type: ignore[no-untyped-def]
    try:
        grp.getgrnam("feos")
        pytest.skip("this machine has a group feos: the next test covers it")
    except KeyError:
        pass
    mode = stat.S_IMODE(os.stat(feosd.socket).st_mode)
    assert mode == 0o600


def test_the_socket_belongs_to_the_group_feos(feosd_factory) -> None:  # type: ignore[no-untyped-def]
    made = False
    try:
        grp.getgrnam("feos")
    except KeyError:
        subprocess.run(["groupadd", "--system", "feos"], check=True)
        made = True
    try:
        daemon = feosd_factory().start()
        info = os.stat(daemon.socket)
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == grp.getgrnam("feos").gr_gid
    finally:
        if made:
            subprocess.run(["groupdel", "feos"], check=True)


def test_ready_goes_to_the_notify_socket_once_it_serves(feosd_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(path))
        notify.settimeout(20)
        daemon = feosd_factory(env={"NOTIFY_SOCKET": str(path)})
        daemon.spawn()
        message = notify.recv(4096)
        assert message == b"READY=1"
        # Readiness means the listener is bound: a call answers at once.
        assert daemon.socket.exists()
        assert daemon.ctl("host", "info").returncode == 0


def test_serves_on_tcp_too(feosd_factory) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = feosd_factory("--tcp", f"127.0.0.1:{port}").start()
    daemon.socket = f"127.0.0.1:{port}"  # type: ignore[assignment]
    assert "0.1.0" in daemon.ctl("host", "info").stdout


def test_a_bad_tcp_option_is_refused() -> None:
    from feosd_proc import BIN

    done = subprocess.run([str(BIN / "feosd"), "--tcp", "nonsense"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--tcp: 'nonsense' is not HOST:PORT" in done.stderr


def test_garbage_on_the_socket_closes_that_connection_only(feosd) -> None:  # type: ignore[no-untyped-def]
    for junk in (b"\xff" * 64, b"\x00\x00\x00\x00\x10\x00\x00\x00trunc", os.urandom(4096)):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(feosd.socket))
            sock.sendall(junk)
            sock.settimeout(3)
            try:
                while sock.recv(4096):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    assert feosd.proc.poll() is None
    assert feosd.ctl("volume", "list").returncode == 0


def _client_burst(socket_path: str, acked: list[str], stop: threading.Event) -> None:
    """Create volumes one after another until told to stop, noting each one acknowledged."""
    import asyncio

    import capnp

    from feos.rpc._client import Client

    async def run() -> None:
        try:
            client = await Client.connect(socket_path)
        except FeosError:
            return
        while not stop.is_set():
            volume_id = str(uuid.uuid4())
            try:
                await client.call("volumes", "createVolume", id=volume_id, sizeBytes=64 << 20)
            except FeosError as exc:
                assert exc.code is Code.UNAVAILABLE
                return
            acked.append(volume_id)

    asyncio.run(capnp.run(run()))


def test_kill_9_in_a_burst_of_writes_loses_nothing_acknowledged(feosd) -> None:  # type: ignore[no-untyped-def]
    acked: list[str] = []
    stop = threading.Event()
    workers = [threading.Thread(target=_client_burst, args=(str(feosd.socket), acked, stop))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    time.sleep(random.uniform(1.0, 2.0))
    feosd.kill()
    stop.set()
    for worker in workers:
        worker.join(30)
    assert len(acked) > 10, "the burst made too few writes to mean anything"
    feosd.start()
    kept = {v["id"] for v in feosd.ctl_json("volume", "list")}
    assert set(acked) <= kept
    # Nothing torn: every record parses (a torn one would be set aside and logged).
    assert "unreadable" not in feosd.log_text()


def test_reboot_and_shutdown_refused_in_a_pid_namespace(feosd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = feosd_factory()
    # feosd refuses to be PID 1: a shell is the namespace's init, feosd its child.
    daemon.start(prefix=["unshare", "--pid", "--fork", "--kill-child",
                         "sh", "-c", '"$@" & wait $!', "sh"])
    for verb in ("reboot", "shutdown"):
        done = daemon.ctl("host", verb, check=False)
        assert done.returncode == 19, done.stderr
        assert "PID namespace of its own" in done.stderr


def test_upgrade_needs_self_upgrade(feosd, tmp_path) -> None:  # type: ignore[no-untyped-def]
    binary = tmp_path / "feosd-new"
    binary.write_text("#!/bin/sh\nexit 0\n")
    done = feosd.ctl("host", "upgrade", str(binary), check=False)
    assert done.returncode == 19
    assert "without --self-upgrade" in done.stderr


def test_upgrade_replaces_the_binary_and_keeps_pid_and_socket(feosd_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from feosd_proc import BIN

    program = tmp_path / "bin" / "feosd"
    program.parent.mkdir()
    original = (BIN / "feosd").read_text()
    program.write_text(original)
    program.chmod(0o755)
    daemon = feosd_factory("--self-upgrade")
    daemon.program = [str(program)]
    daemon.start()
    pid = daemon.proc.pid
    before = daemon.ctl_json("host", "info")
    assert before["selfUpgrade"] is True

    wrong = daemon.ctl("host", "upgrade", str(program), "--sha256", "0" * 64, check=False)
    assert wrong.returncode == 13
    assert "sha256" in wrong.stderr

    new = tmp_path / "feosd-new"
    new.write_text(original + "\n# upgraded\n")
    daemon.ctl("host", "upgrade", str(new))
    deadline = time.monotonic() + 20
    after = before
    while time.monotonic() < deadline:
        done = daemon.ctl("--json", "host", "info", check=False)
        if done.returncode == 0:
            import json

            after = json.loads(done.stdout)
            if after["startedUnixNs"] != before["startedUnixNs"]:
                break
        time.sleep(0.1)
    assert after["startedUnixNs"] != before["startedUnixNs"], daemon.log_text()
    assert after["pid"] == pid
    assert daemon.proc.poll() is None
    assert program.read_text().endswith("# upgraded\n")
    assert (daemon.state_dir / "feosd.lock").read_text().strip() == str(pid)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(20) == 0
