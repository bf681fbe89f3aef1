"""The resolver's sockets handed over by systemd's protocol, to a child and across an exec."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from conftest import Netns
from feos.net import _dnsmsg as m

ADDRESS = "127.0.0.53"

# The child takes its sockets, reports what it has, and for "serve" answers until told to stop.
CHILD = textwrap.dedent(
    """
    import ipaddress, json, os, sys
    from feos.net._listenfds import take_dns_sockets
    got = take_dns_sockets(ipaddress.IPv4Address(sys.argv[1]), 53)
    def is_socket(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            return False  # the listing's own fd
    fds = [fd for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")) if is_socket(fd)]
    report = {
        "pid": os.getpid(),
        "taken": None if got is None else [got.udp.fileno(), got.tcp.fileno()],
        "cloexec": None if got is None else [not s.get_inheritable() for s in (got.udp, got.tcp)],
        "env": [k for k in os.environ if k.startswith("LISTEN_")],
        "fds": fds,
    }
    print(json.dumps(report), flush=True)
    if len(sys.argv) > 2 and got is not None:
        import trio
        from feos.net._dnsresolver import PodDns
        from feos.net._dnsserver import DnsServer
        from feos.net._nametable import NameTable
        table = NameTable.parse("t", 1, {"upgraded": ["10.9.9.9"]})
        async def main():
            server = DnsServer(got, pod_for=lambda a: PodDns("p", ("t",)),
                               name_tables=lambda: {"t": table}, on_record=lambda r: None)
            async with trio.open_nursery() as n:
                await n.start(server.serve)
                server.pods_loaded()
                await trio.sleep(float(sys.argv[2]))
                n.cancel_scope.cancel()
        trio.run(main)
    """
)

# The old binary: binds the sockets, gets a query queued, and execs the new one with the same pid.
UPGRADER = textwrap.dedent(
    """
    import ipaddress, os, sys
    from feos.net._listenfds import bind_dns_sockets, prepare_exec
    sockets = bind_dns_sockets(ipaddress.IPv4Address(sys.argv[1]), 53)
    print(os.getpid(), flush=True)
    sys.stdin.readline()  # the test has sent its query: it waits in the socket
    env = prepare_exec(sockets)
    os.execve(sys.executable, [sys.executable, sys.argv[2], sys.argv[1], "3"], env)
    """
)


def query(ident: int, name: bytes) -> bytes:
    return m.build_message(m.Message(ident, m.RD, (m.Question((name,), m.A),)))


def test_systemd_handover_takes_the_dns_sockets_and_closes_the_rest(
    netns: Netns, tmp_path: Path
) -> None:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    # Made in the namespace by a helper that passes them on as systemd would: fds 3..6, named,
    # LISTEN_PID set by the shell that execs into the child (so it is the child's pid).
    helper = tmp_path / "helper.py"
    helper.write_text(
        textwrap.dedent(f"""
        import os, socket, subprocess, sys
        def sock(kind, port, listen=False):
            s = socket.socket(socket.AF_INET, kind)
            s.bind(("{ADDRESS}", port))
            if listen:
                s.listen()
            return s
        socks = [sock(socket.SOCK_DGRAM, 53), sock(socket.SOCK_DGRAM, 5353),
                 sock(socket.SOCK_STREAM, 53, True), sock(socket.SOCK_STREAM, 54, True)]
        names = "dns:dns:dns:other"
        redirect = " ".join(f"{{3 + i}}<&{{s.fileno()}}" for i, s in enumerate(socks))
        env = f"LISTEN_PID=$$ LISTEN_FDS=4 LISTEN_FDNAMES={{names}}"
        script = f"{{env}} exec {{sys.executable}} {child} {ADDRESS} {{redirect}}"
        subprocess.run(["sh", "-c", script], pass_fds=[s.fileno() for s in socks], check=True)
    """)
    )
    out = netns.run(sys.executable, str(helper)).stdout
    report = json.loads(out.splitlines()[-1])
    assert report["taken"] is not None
    assert report["cloexec"] == [True, True]
    assert report["env"] == []
    # fds 3 and 5 (UDP and TCP at :53) taken; 4 (port 5353) and 6 (named other) closed.
    assert report["taken"] == [3, 5]
    assert report["fds"] == [3, 5]


def test_a_handover_for_another_pid_is_ignored(netns: Netns, tmp_path: Path) -> None:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    out = netns.run(
        "env",
        "LISTEN_PID=1",
        "LISTEN_FDS=2",
        "LISTEN_FDNAMES=dns:dns",
        sys.executable,
        str(child),
        ADDRESS,
    ).stdout
    report = json.loads(out)
    assert report["taken"] is None
    assert report["env"] == []


def test_self_upgrade_keeps_the_sockets_and_the_waiting_query(netns: Netns, tmp_path: Path) -> None:
    child, upgrader = tmp_path / "child.py", tmp_path / "upgrader.py"
    child.write_text(CHILD)
    upgrader.write_text(UPGRADER)
    proc = netns.popen(
        sys.executable, str(upgrader), ADDRESS, str(child), stdin=-1, stdout=-1, text=True
    )
    try:
        pid = int(proc.stdout.readline())
        # A client in the namespace: a query sent before the exec is answered by the new binary.
        client = netns.popen(
            sys.executable,
            "-c",
            "import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
            "s.settimeout(10);"
            f"s.sendto(bytes.fromhex(sys.argv[1]), ('{ADDRESS}', 53)); print(s.recv(512).hex())",
            query(0x5151, b"upgraded").hex(),
            stdout=-1,
            text=True,
        )
        proc.stdin.write("go\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        answer = m.parse_message(bytes.fromhex(client.communicate(timeout=15)[0].strip()))
        assert report["pid"] == pid  # the same process, a new binary
        assert report["taken"] is not None
        assert report["env"] == []
        assert answer.id == 0x5151
        assert answer.answers[0].rdata == bytes([10, 9, 9, 9])
        assert proc.wait(15) == 0
    finally:
        proc.kill()
        proc.communicate()
