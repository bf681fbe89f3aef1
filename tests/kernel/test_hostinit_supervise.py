"""feos-host-init's supervisor with real processes: a program that ends is started again a second
later (no spin), feosd's kind gets the resolver's sockets at fds 3 and 4 with systemd's
variables (LISTEN_PID its own pid), and an orphan is reaped; their output comes line by line
as records."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from pathlib import Path

from feos.hostinit._plan import LINE_MAX
from feos.hostinit._supervise import Program, Supervisor
from feos.hostinit._system import bind_resolver_sockets


def test_restart_a_second_later_and_sockets_handed_over(tmp_path: Path) -> None:
    out = tmp_path / "starts"
    fds = tmp_path / "fds"
    script = (f'echo "$(date +%s.%N)" >> {out}; '
              f'echo "$LISTEN_PID $$ $LISTEN_FDS $LISTEN_FDNAMES $(readlink /proc/$$/fd/3) '
              f'$(readlink /proc/$$/fd/4)" > {fds}; exit 3')

    async def main() -> tuple[list[float], str]:
        udp, tcp = bind_resolver_sockets("127.0.0.53", 0)
        assert udp.getsockopt(socket.SOL_IP, 15)  # IP_FREEBIND
        sup = Supervisor([udp, tcp])
        sup.install()
        sup.add(Program("crashy", lambda: ["/bin/sh", "-c", script], dns=True))
        await asyncio.sleep(3.6)
        await sup.stop(2.0)  # not PID 1: it ends its own programs only
        udp.close()
        tcp.close()
        return [float(x) for x in out.read_text().split()], fds.read_text().split()

    # In a child: the supervisor reaps with waitpid(-1), which must see only the child's own.
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            starts, got = asyncio.run(main())
            ok = len(starts) >= 3 and all(0.9 <= b - a <= 1.6 for a, b in itertools.pairwise(starts))
            ok = ok and got[0] == got[1] and got[2:4] == ["2", "dns:dns"]
            ok = ok and got[4].startswith("socket:") and got[5].startswith("socket:")
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (out.read_text() if out.exists() else "",
                                                     fds.read_text() if fds.exists() else "")


def test_output_relayed_line_by_line_as_records() -> None:
    """A program's stdout and stderr, and its child's, reach `output` as one record a line,
    across its starts; a line longer than a record comes in pieces."""
    records: list[bytes] = []
    script = ('echo "one"; echo "two WARNING x" >&2; sh -c "echo child"; '
              f'head -c {LINE_MAX + 10} /dev/zero | tr "\\0" a; echo; exit 1')

    async def main() -> None:
        sup = Supervisor(output=records.append)
        sup.install()
        sup.add(Program("talky", lambda: ["/bin/sh", "-c", script]))
        deadline = asyncio.get_running_loop().time() + 10
        while sum(r == b"<6>talky: one\n" for r in records) < 2:  # a second start's, too
            assert asyncio.get_running_loop().time() < deadline, records
            await asyncio.sleep(0.1)
        await sup.stop(2.0)

    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            asyncio.run(main())
            first = records[:5]
            ok = first == [b"<6>talky: one\n", b"<4>talky: two WARNING x\n", b"<6>talky: child\n",
                           b"<6>talky: " + b"a" * LINE_MAX + b"\n", b"<6>talky: aaaaaaaaaa\n"]
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
