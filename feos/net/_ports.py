"""Published ports: which publishes overlap, and who on the node holds a port.

A publish's host address is "" (every address of the node, both families), "0.0.0.0" (every
IPv4 address), "::" (every IPv6 address) or one address. Two publishes of one protocol and host
port overlap when some address is in both. The node holds a port when a socket of its namespace
listens on it (TCP LISTEN, UDP bound and unconnected), read from /proc/net; a socket of feosd's
own process is feosd's (its API, or a relay of a published ::1 port).

Link-local addresses (169.254.0.0/16: the resolver, OTLP and the metadata address; fe80::/10)
are never forwarded: "every address" leaves them out, and naming one is refused.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Sequence

import attrs

from feos.errors import Code, FeosError, invalid

from ._contract import PublishedPort

Addr = ipaddress.IPv4Address | ipaddress.IPv6Address
ANY4, ANY6 = "0.0.0.0", "::"
PROTOCOLS = ("tcp", "udp")
LINK_LOCAL4 = ipaddress.IPv4Network("169.254.0.0/16")
LINK_LOCAL6 = ipaddress.IPv6Network("fe80::/10")


def families(host_address: str) -> tuple[int, ...]:
    """The IP versions a host address covers."""
    if host_address == "":
        return (4, 6)
    return (ipaddress.ip_address(host_address).version,)


def is_wildcard(host_address: str) -> bool:
    return host_address in ("", ANY4, ANY6)


def overlaps(a: PublishedPort, b: PublishedPort) -> bool:
    """Whether a connection could match both (same protocol and port, an address in both)."""
    if a.protocol != b.protocol or a.host_port != b.host_port:
        return False
    if not set(families(a.host_address)) & set(families(b.host_address)):
        return False
    return is_wildcard(a.host_address) or is_wildcard(b.host_address) or (
        ipaddress.ip_address(a.host_address) == ipaddress.ip_address(b.host_address))


def check_publish(ports: Sequence[PublishedPort], field: str) -> None:
    """The values of a spec's publish list: INVALID_ARGUMENT naming `field[i]`'s part."""
    for i, p in enumerate(ports):
        where = f"{field}[{i}]"
        if p.protocol not in PROTOCOLS:
            raise invalid(f"{where}.protocol", "must be tcp or udp")
        for name, port in (("hostPort", p.host_port), ("podPort", p.pod_port)):
            if not isinstance(port, int) or not 1 <= port <= 65535:
                raise invalid(f"{where}.{name}", "must be 1 to 65535")
        _check_address(p.host_address, f"{where}.hostAddress")
        for j, q in enumerate(ports[:i]):
            if overlaps(p, q):
                raise invalid(where, f"{p.text()} overlaps {field}[{j}] ({q.text()})")


def _check_address(text: str, where: str) -> None:
    if text == "":
        return
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise invalid(where, f"{text!r} is not an IPv4 or IPv6 address "
                             "(empty: every address of the node)") from None
    if addr.is_multicast or (isinstance(addr, ipaddress.IPv4Address) and addr.is_reserved):
        raise invalid(where, f"{addr} is not an address of a node")
    if addr in LINK_LOCAL4 or addr in LINK_LOCAL6:
        raise invalid(where, f"{addr} is link-local: the resolver, OTLP and the metadata "
                             "address live there, and link-local addresses are not published")


# --- who holds a port ------------------------------------------------------------------------


@attrs.frozen
class Listener:
    protocol: str
    address: Addr
    port: int
    inode: int


_STATES = {"tcp": "0A", "udp": "07"}  # LISTEN; an unconnected UDP socket


PROC_FILES = ("tcp", "tcp6", "udp", "udp6")


def open_proc_net() -> dict[str, int]:
    """/proc/net's socket tables of the calling thread's namespace, opened: a file read later
    from any thread still lists the namespace it was opened in (run in that namespace)."""
    fds = {}
    for name in PROC_FILES:
        try:
            fds[name] = os.open(f"/proc/thread-self/net/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            pass  # a kernel without IPv6
    return fds


def read_listeners(fds: dict[str, int]) -> list[Listener]:
    """The sockets listening in the namespace the files were opened in (a few KiB of /proc)."""
    out = []
    for name, fd in fds.items():
        out += _parse_proc(_read(fd), name[:3], 6 if name.endswith("6") else 4)
    return out


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def _parse_proc(text: str, proto: str, version: int) -> list[Listener]:
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _STATES[proto]:
            continue
        hexaddr, _, hexport = fields[1].partition(":")
        out.append(Listener(proto, _proc_address(hexaddr, version), int(hexport, 16),
                            int(fields[9])))
    return out


def _proc_address(hexaddr: str, version: int) -> Addr:
    raw = bytes.fromhex(hexaddr)
    if version == 4:
        return ipaddress.IPv4Address(raw[::-1])
    # four 32-bit words, each in the host's (little-endian) order
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def own_socket_inodes() -> set[int]:
    """The inodes of this process's sockets (feosd's API, resolver, relays)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listener_covers(port: PublishedPort, listener: Listener) -> bool:
    """Whether a connection to the publish could be one the listener takes."""
    if listener.protocol != port.protocol or listener.port != port.host_port:
        return False
    addr = listener.address
    if addr in LINK_LOCAL4 or addr in LINK_LOCAL6:
        return False  # never forwarded
    if addr.is_unspecified:  # :: takes IPv4 too, unless IPV6_V6ONLY: assume it does
        wild = (4, 6) if addr.version == 6 else (4,)
        return bool(set(families(port.host_address)) & set(wild))
    if is_wildcard(port.host_address):
        return addr.version in families(port.host_address)
    return ipaddress.ip_address(port.host_address) == addr


def holder_of_port(port: PublishedPort, listeners: Iterable[Listener],
                   own: set[int]) -> str | None:
    """Who on the node holds the publish's port: None, feosd itself, or the node."""
    for li in listeners:
        if listener_covers(port, li):
            host = f"[{li.address}]" if li.address.version == 6 else str(li.address)
            if li.inode in own:
                return f"feosd itself listens on {host}:{li.port}/{li.protocol} (its API)"
            return f"the node listens on {host}:{li.port}/{li.protocol}"
    return None


def already_held(where: str, port: PublishedPort, holder: str) -> FeosError:
    return FeosError(Code.ALREADY_EXISTS, f"{where}: {port.text()}: {holder}")
