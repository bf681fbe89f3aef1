"""The resolver's sockets across restarts: systemd's socket protocol (sd_listen_fds), both ways.

Whoever holds the sockets while feosd is not running (feosd.socket, feos-host-init, or feosd itself
before a self-upgrade's exec) passes them from fd 3 on, with LISTEN_FDS (how many), LISTEN_PID
(the pid they are for) and LISTEN_FDNAMES (their names, colon-separated; ours are named dns).
take_dns_sockets runs before feosd starts threads: it takes the UDP socket and the listening TCP
socket named dns that are bound to the resolver's address and port, closes every other fd handed
over, and removes the variables, so that nothing feosd runs inherits them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
from collections.abc import MutableMapping

import attrs

from feos.errors import Code, FeosError

LISTEN_FDS_START = 3
DNS_NAME = "dns"
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)


@attrs.frozen
class DnsSockets:
    """The resolver's UDP socket and listening TCP socket (close-on-exec, blocking as given)."""

    udp: socket.socket
    tcp: socket.socket
    handed_over: bool  # taken from LISTEN_FDS rather than bound by us

    def close(self) -> None:
        self.udp.close()
        self.tcp.close()


def take_dns_sockets(
    address: ipaddress.IPv4Address,
    port: int = 53,
    environ: MutableMapping[str, str] | None = None,
) -> DnsSockets | None:
    """The handed-over sockets for address:port, or None if none were handed to this process.

    The variables are removed in every case; fds handed to another pid are not ours to close.
    """
    env = os.environ if environ is None else environ
    values = {k: env.pop(k, None) for k in _VARIABLES}
    if values["LISTEN_PID"] is None or values["LISTEN_FDS"] is None:
        return None
    try:
        pid, count = int(values["LISTEN_PID"]), int(values["LISTEN_FDS"])
    except ValueError:
        return None
    if pid != os.getpid() or count <= 0:
        return None
    names = (values["LISTEN_FDNAMES"] or "").split(":")
    udp = tcp = None
    for i in range(count):
        fd = LISTEN_FDS_START + i
        name = names[i] if i < len(names) else "unknown"
        sock = _adopt(fd) if name == DNS_NAME else None
        kind = None if sock is None else _kind(sock, address, port)
        if kind == "udp" and udp is None:
            udp = sock
        elif kind == "tcp" and tcp is None:
            tcp = sock
        else:
            _close(fd, sock)
    if udp is None or tcp is None:
        for sock in (udp, tcp):
            if sock is not None:
                sock.close()
        return None
    return DnsSockets(udp, tcp, handed_over=True)


def _adopt(fd: int) -> socket.socket | None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    sock.set_inheritable(False)
    return sock


def _close(fd: int, sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()
        return
    try:
        os.close(fd)
    except OSError:
        pass


def _kind(sock: socket.socket, address: ipaddress.IPv4Address, port: int) -> str | None:
    """ "udp" or "tcp" if the socket is one of the resolver's, bound to address:port."""
    try:
        if sock.family != socket.AF_INET or sock.getsockname() != (str(address), port):
            return None
        if sock.type == socket.SOCK_DGRAM:
            return "udp"
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        return "tcp" if sock.type == socket.SOCK_STREAM and listening else None
    except OSError:
        return None


def bind_dns_sockets(address: ipaddress.IPv4Address, port: int = 53) -> DnsSockets:
    """Our own sockets at address:port, bound with IP_FREEBIND before the node holds the address."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for sock in (udp, tcp):
            sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((str(address), port))
        tcp.listen(1024)
    except OSError as e:
        udp.close()
        tcp.close()
        raise FeosError(Code.UNAVAILABLE, f"the resolver cannot bind {address}:{port}: {e}") from e
    return DnsSockets(udp, tcp, handed_over=False)


def prepare_exec(sockets: DnsSockets) -> dict[str, str]:
    """Put the sockets at fds 3 and 4, inheritable, and return the environment for an exec of our
    own binary with this pid (a self-upgrade). Call it last before os.execve: whatever held fds 3
    and 4 is replaced (feosd's own files there are close-on-exec and of no use after the exec)."""
    # Move both out of the way first: a dup2 onto 3 must not close the socket that goes to 4.
    high = [fcntl.fcntl(s.fileno(), fcntl.F_DUPFD_CLOEXEC, 10) for s in (sockets.udp, sockets.tcp)]
    for i, fd in enumerate(high):
        os.dup2(fd, LISTEN_FDS_START + i, inheritable=True)
        os.close(fd)
    env = dict(os.environ)
    env.update(
        LISTEN_PID=str(os.getpid()),
        LISTEN_FDS="2",
        LISTEN_FDNAMES=f"{DNS_NAME}:{DNS_NAME}",
    )
    return env
