"""feos-host-init's pure decisions: the command line's pod prefix, resolv.conf, the order of the
NTP servers, a DHCPv4 lease's routes and a DHCPv6 lease's timers.

Nothing here does I/O: the loops in _main, _dhcp4, _dhcp6 and _ntp feed these what they learned
and do what these say (tests/unit/test_hostinit_plan.py).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

import attrs

from feos.errors import Code, FeosError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

POD_PREFIX_KEY = "feos.pod-prefix"
# The initramfs's resolvers (Google's and Cloudflare's), until DHCP names any.
INITRAMFS_RESOLVERS: tuple[IPAddress, ...] = (
    ipaddress.ip_address("2001:4860:4860::8888"),
    ipaddress.ip_address("8.8.8.8"),
    ipaddress.ip_address("2606:4700:4700::1111"),
    ipaddress.ip_address("1.1.1.1"),
)
NTP_POOL = "pool.ntp.org"
NTP_WAIT_S = 5.0
DHCP6_WAIT_S = 30.0


def parse_pod_prefix(text: str) -> ipaddress.IPv6Network:
    """A pod prefix as feosd takes it (--pod-prefix: IPv6, /1 to /120), or INVALID_ARGUMENT."""
    try:
        net = ipaddress.IPv6Network(text, strict=True)
    except ValueError as exc:
        raise FeosError(Code.INVALID_ARGUMENT, f"{POD_PREFIX_KEY}={text}: {exc}") from exc
    if not 1 <= net.prefixlen <= 120:
        why = f"{POD_PREFIX_KEY}={text}: the length must be 1 to 120, not {net.prefixlen}"
        raise FeosError(Code.INVALID_ARGUMENT, why)
    return net


def cmdline_pod_prefix(cmdline: str) -> ipaddress.IPv6Network | None:
    """The pod prefix the kernel's command line names, None if none (the last one counts).

    A bad one raises INVALID_ARGUMENT; the caller logs it and goes on as if there were none.
    """
    value = None
    for word in cmdline.split():
        key, _, rest = word.partition("=")
        if key == POD_PREFIX_KEY:
            value = rest
    return None if value is None else parse_pod_prefix(value)


def resolvers_in_turn(
    v6: Sequence[ipaddress.IPv6Address], v4: Sequence[ipaddress.IPv4Address]
) -> list[IPAddress]:
    """Both families' resolvers in turn, IPv6 first, each once: glibc reads only three, so a
    node with one family broken still has the other's within them."""
    out: list[IPAddress] = []
    for i in range(max(len(v6), len(v4))):
        for family in (v6, v4):
            if i < len(family) and family[i] not in out:
                out.append(family[i])
    return out


def resolv_conf(v6: Sequence[ipaddress.IPv6Address], v4: Sequence[ipaddress.IPv4Address]) -> str:
    """/etc/resolv.conf: DHCP's resolvers in turn, or the initramfs's while DHCP named none."""
    servers = resolvers_in_turn(v6, v4) or list(INITRAMFS_RESOLVERS)
    by = "DHCP" if v6 or v4 else "the initramfs (no DHCP server named any yet)"
    lines = [f"# written by feos-host-init: the resolvers of {by}"]
    lines += [f"nameserver {s}" for s in servers]
    return "\n".join(lines) + "\n"


@attrs.frozen
class NtpServer:
    """One server to ask: a name or an address, and the family to reach it by (4 or 6)."""

    host: str
    family: int


def ntp_order(
    dhcp6: Iterable[IPAddress | str], dhcp4: Iterable[ipaddress.IPv4Address]
) -> list[NtpServer]:
    """DHCPv6's servers, then DHCPv4's, then pool.ntp.org by IPv6, else by IPv4."""
    out: list[NtpServer] = []
    for s in dhcp6:
        fam = 4 if isinstance(s, ipaddress.IPv4Address) else 6
        out.append(NtpServer(str(s), fam))
    out += [NtpServer(str(s), 4) for s in dhcp4]
    out += [NtpServer(NTP_POOL, 6), NtpServer(NTP_POOL, 4)]
    return out


@attrs.frozen
class Route4:
    """A route to add for a lease: dst None is the default route."""

    dst: ipaddress.IPv4Network | None
    gateway: ipaddress.IPv4Address | None


def lease4_routes(
    address: ipaddress.IPv4Interface, routers: Sequence[ipaddress.IPv4Address]
) -> list[Route4]:
    """The default route by the lease's first router; where the router is outside the lease's
    prefix, an on-link route to it first, so the kernel can reach it on the link."""
    if not routers:
        return []
    router = routers[0]
    out: list[Route4] = []
    if router not in address.network:
        out.append(Route4(ipaddress.IPv4Network(f"{router}/32"), None))
    out.append(Route4(None, router))
    return out


@attrs.frozen
class Timers6:
    """When to renew (T1), rebind (T2) and when the lease ends, in seconds from the reply."""

    t1: float
    t2: float
    end: float


INFINITY = 0xFFFFFFFF


def lease6_timers(t1: int, t2: int, lifetimes: Sequence[tuple[int, int]]) -> Timers6:
    """RFC 8415's timers for one IA: T1 and T2 as the server gave them, or 0.5 and 0.8 of the
    shortest preferred lifetime where it left them to the client (0); the lease ends with the
    longest valid lifetime. lifetimes: (preferred, valid) of each address or prefix."""
    if not lifetimes:
        raise FeosError(Code.INVALID_ARGUMENT, "a DHCPv6 lease without addresses or prefixes")
    preferred = min(p for p, _ in lifetimes)
    valid = max(v for _, v in lifetimes)
    end = float("inf") if valid == INFINITY else float(valid)
    base = float("inf") if preferred == INFINITY else float(preferred)
    r1 = float("inf") if t1 == INFINITY else float(t1) if t1 else base * 0.5
    r2 = float("inf") if t2 == INFINITY else float(t2) if t2 else base * 0.8
    r2 = min(max(r2, r1), end)
    return Timers6(t1=min(r1, r2), t2=r2, end=end)


# The API on TCP (feosd --tcp, docs/host-init.md "The API on TCP"): what the image or a second
# initramfs of the site's holds in /etc/feos.
TCP_CLIENT_CA = "/etc/feos/tcp-client-ca.pem"  # the operator's CA: clients it signed are served
TCP_CERT = "/etc/feos/tcp-cert.pem"  # the node's own certificate and key (else feosd makes one)
TCP_KEY = "/etc/feos/tcp-key.pem"
TCP_INSECURE_WORD = "feos.tcp-insecure=1"


def tcp_options(present: Iterable[str], cmdline: str) -> tuple[list[str], str]:
    """feosd's options for the API on [::]:1337, and the console's line about them: TLS with
    client certificates of the operator's CA where the node has one (its own certificate and key
    too, where given); plain TCP only when the kernel's command line asks for it by name; else
    no TCP at all (the control plane still reaches the node through its own link)."""
    have = set(present)
    if TCP_CLIENT_CA in have:
        args = ["--tcp", "[::]:1337", "--tcp-client-ca", TCP_CLIENT_CA]
        if TCP_CERT in have and TCP_KEY in have:
            args += ["--tcp-cert", TCP_CERT, "--tcp-key", TCP_KEY]
        return args, f"the API on [::]:1337 over TLS, clients of {TCP_CLIENT_CA}"
    if TCP_INSECURE_WORD in cmdline.split():
        return (["--tcp", "[::]:1337", "--tcp-insecure"],
                f"the API on [::]:1337 WITHOUT TLS ({TCP_INSECURE_WORD}): anyone who reaches "
                "it runs code as root")  # fmt: skip
    return [], (f"no API on TCP: the node has no {TCP_CLIENT_CA} (docs/host-init.md), and the "
                f"command line does not say {TCP_INSECURE_WORD}")  # fmt: skip


def pod_prefix_after_delegation(
    current: ipaddress.IPv6Network | None,
    delegated: ipaddress.IPv6Network | None,
    fixed: bool,
) -> tuple[ipaddress.IPv6Network | None, bool]:
    """The pod prefix once DHCPv6 delegated `delegated` (None: its lease has no prefix), and
    whether a feosd already running must start again to take it. The command line's prefix
    (`fixed`) stays; a prefix lost keeps the one feosd runs with; a first delegation after feosd
    started without one (DHCPv6 answered after its 30 s) is taken as a new one is."""
    if fixed or delegated is None or delegated == current:
        return current, False
    return delegated, True


# A line of diskd's or feosd's output as a /dev/kmsg record (host-init relays them: the console
# then has the kernel's printk as its one writer, and a record is never split by another's).
LINE_MAX = 900  # of a record's text: /dev/kmsg refuses records over 1024 bytes with its prefix
_LEVELS = ((b" CRITICAL ", 2), (b" ERROR ", 3), (b" WARNING ", 4))


def program_records(name: str, line: bytes) -> list[bytes]:
    """One line of a program's output as /dev/kmsg records `<level>name: text\\n`, the level
    its logging's where the line carries one (feos's format: `DATE TIME PROGRAM LEVEL ...`,
    else info), a line too long for one record in pieces, a line's end and NULs dropped."""
    text = line.rstrip(b"\r\n").replace(b"\0", b"")
    head = text[:48]
    level = next((lvl for word, lvl in _LEVELS if word in head), 6)
    pieces = [text[i : i + LINE_MAX] for i in range(0, len(text), LINE_MAX)] or [b""]
    return [b"<%d>%s: %s\n" % (level, name.encode(), p) for p in pieces]
