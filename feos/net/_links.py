"""The node's start-up steps for the pods' network and each pod's TAP device (node.md).

Theory of operation. Every step looks at what is there, does what is missing and reads it back
(a cut-off start or bring-up resumes where it ended). All netlink work runs in a worker thread
with an IPRoute made on that thread and closed before it returns (pyroute2's objects are tied
to their thread): the async functions here are `trio.to_thread.run_sync` of a sync function
that takes a fresh IPRoute. With `netns` set (the tests), the worker thread enters the named
namespace for the call and leaves it after, so /proc/sys/net and the sockets it opens are the
namespace's.

The QEMU pods' metadata service answers at 169.254.169.254 on the pod's own TAP: a policy rule
per TAP (iif pod-..., to 169.254.169.254) looks up METADATA_TABLE, which routes the address as
local; nothing else on the node sees it as local, so the node's own cloud metadata service stays
reachable for the node.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import ipaddress
import logging
import os
import re
import socket
import struct
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs
import trio
from pyroute2 import IPRoute  # type: ignore[import-untyped]
from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]

from feos.errors import Code, FeosError, invalid

from .. import native
from ._options import GATEWAY4, METADATA4, NetworkOptions

log = logging.getLogger(__name__)

DNS_DEVICE = "feos-dns"
METADATA_TABLE = 169254
METADATA_RULE_PRIORITY = 1000
GATEWAY6_CIDR = "fe80::1"
NTF_PROXY = 0x08
IFA_F_NODAD = 0x02
CLONE_NEWNET = 0x40000000
IFF_TUN, IFF_TAP, IFF_NO_PI, IFF_MULTI_QUEUE, IFF_VNET_HDR = 0x1, 0x2, 0x1000, 0x100, 0x4000
TUNSETIFF, TUNSETPERSIST, TUNSETOWNER, TUNSETGROUP = 0x400454CA, 0x400454CB, 0x400454CC, 0x400454CE

_SHORT_ID = re.compile(r"^[a-hjkmnp-tv-z][0-9a-hjkmnp-tv-z]{10}$")
T = TypeVar("T")


# --- names ----------------------------------------------------------------------------------


def _uuid(pod_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(pod_id)
    except ValueError:
        return None


def tap_name(pod_id: str) -> str:
    """pod-<ID> for a short ID; pod-<its first 8 hex digits> for a pod with a UUID."""
    u = _uuid(pod_id)
    if u is not None:
        return f"pod-{u.hex[:8]}"
    if not _SHORT_ID.match(pod_id):
        raise invalid("pod_id", "must be 11 lowercase Crockford base32 characters or a UUID")
    return f"pod-{pod_id}"


def guest_mac(pod_id: str) -> str:
    """06:00 and the first four bytes of sha256(ID); for a UUID, its TAP's 8 hex digits."""
    u = _uuid(pod_id)
    tail = bytes.fromhex(u.hex[:8]) if u is not None else hashlib.sha256(pod_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x06, 0x00, *tail[:4]))


# --- threads, namespaces, sysctls -----------------------------------------------------------


@contextlib.contextmanager
def netns_entered(netns: str | None) -> Iterator[None]:
    """Run the calling thread in the named namespace until the block ends (None: stay)."""
    if netns is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


def _setns(fd: int) -> None:
    native.setns(fd, CLONE_NEWNET)


async def in_thread(netns: str | None, fn: Callable[..., T], *args: Any) -> T:
    """Run fn(ipr, *args) on a worker thread with an IPRoute of its own, in `netns`."""

    def work() -> T:
        with netns_entered(netns), IPRoute() as ipr:
            return fn(ipr, *args)

    return await trio.to_thread.run_sync(work)


def sysctl_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def read_sysctl(key: str) -> str:
    with open(sysctl_path(key)) as f:
        return f.read().strip()


def ensure_sysctl(key: str, value: str) -> None:
    """Write a sysctl only if it differs, and read it back."""
    if read_sysctl(key) == value:
        return
    with open(sysctl_path(key), "w") as f:
        f.write(value)
    if (got := read_sysctl(key)) != value:
        raise FeosError(Code.INTERNAL, f"sysctl {key} is {got} after writing {value}")


def _iface_key(prefix: str, ifname: str, leaf: str) -> str:
    # A dot in an interface name is a slash in the sysctl's path: write the key path-wise.
    return f"{prefix}.{ifname.replace('.', '/')}.{leaf}"


# --- netlink helpers ------------------------------------------------------------------------


def _index(ipr: IPRoute, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def _addrs(ipr: IPRoute, index: int, family: int) -> list[tuple[str, int, int]]:
    out = []
    for m in ipr.get_addr(index=index, family=family):
        flags = m.get("IFA_FLAGS") or m["flags"]
        out.append((m.get("IFA_ADDRESS"), m["prefixlen"], flags))
    return out


def _translate(what: str, e: NetlinkError) -> FeosError:
    return FeosError(Code.UNAVAILABLE, f"{what}: {os.strerror(e.code)}")


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """Name the step in the error a failing netlink call or sysctl write becomes."""
    try:
        yield
    except NetlinkError as e:
        raise _translate(what, e) from None
    except OSError as e:
        raise FeosError(Code.UNAVAILABLE, f"{what}: {e.strerror or e}") from None


def create_tuntap(name: str, kind: int, owner_uid: int | None) -> None:
    """A persistent TUN or TAP device in the calling thread's namespace, without packet info
    (as QEMU and Firecracker open it: the flags of a queue they attach replace these), owned by
    `owner_uid` and its group of the same number (a microVM's user: vmm/_jail.py)."""
    _attached_tuntap(name, kind | IFF_NO_PI, owner_uid, persist=True)


def make_bare_tap(name: str) -> None:
    """A TAP with no address nor route: a pod template's, whose guest never sends through it
    (feos.pods' templates); deleted with delete_tap."""
    create_tuntap(name, IFF_TAP, None)


def give_tuntap(name: str, flags: int, owner_uid: int) -> None:
    """An existing device (not attached by anyone: a VMM holding it makes this EBUSY) given to
    `owner_uid`; `flags` are its own (multi-queue must match, vnet_hdr is kept)."""
    _attached_tuntap(name, flags, owner_uid, persist=False)


def _attached_tuntap(name: str, flags: int, owner_uid: int | None, *, persist: bool) -> None:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
        if owner_uid is not None:
            fcntl.ioctl(fd, TUNSETOWNER, owner_uid)
            fcntl.ioctl(fd, TUNSETGROUP, owner_uid)
        if persist:
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def tun_info(ipr: IPRoute, index: int) -> dict[str, int]:
    """The device's tun attributes (IFLA_TUN_OWNER, _GROUP, _MULTI_QUEUE, _VNET_HDR...), read
    by netlink: /sys/class/net shows the namespace sysfs was mounted in, not the thread's."""
    data = ipr.get_links(index)[0].get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA")
    return dict(data["attrs"]) if data else {}


# --- start-up steps -------------------------------------------------------------------------


@attrs.frozen
class NodeSetup:
    """What the start-up steps found or did, for the log and `feosctl host info`."""

    dns_device_kind: str
    accept_ra_raised: tuple[str, ...]


def _forwarding(ipr: IPRoute) -> tuple[str, ...]:
    raised = []
    for link in ipr.get_links():
        name = link.get("IFLA_IFNAME")
        if name == "lo":
            continue  # takes no advertisements whatever its setting says
        key = _iface_key("net.ipv6.conf", name, "accept_ra")
        with contextlib.suppress(FileNotFoundError):
            if read_sysctl(key) == "1":
                ensure_sysctl(key, "2")
                raised.append(name)
    ensure_sysctl("net.ipv4.ip_forward", "1")
    ensure_sysctl("net.ipv6.conf.all.forwarding", "1")
    return tuple(raised)


def _unreachable(ipr: IPRoute, prefix: ipaddress.IPv6Network) -> None:
    for r in ipr.get_routes(family=10):  # a dump: "get" with a dst would ask for a route
        if (r.get("RTA_DST"), r["dst_len"], r["type"]) == (
                str(prefix.network_address), prefix.prefixlen, 7):  # RTN_UNREACHABLE
            return
    ipr.route("replace", dst=str(prefix), type="unreachable", family=10)


def _dns_device(ipr: IPRoute) -> tuple[int, str]:
    """feos-dns: a dummy device where the kernel has them, else a TUN device kept up."""
    idx = _index(ipr, DNS_DEVICE)
    if idx is not None:
        info = ipr.get_links(idx)[0].get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND")
        return idx, info or "tun"
    try:
        ipr.link("add", ifname=DNS_DEVICE, kind="dummy")
        kind = "dummy"
    except NetlinkError as e:
        if e.code not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOENT):
            raise _translate(f"create {DNS_DEVICE}", e) from None
        create_tuntap(DNS_DEVICE, IFF_TUN, None)
        kind = "tun"
        log.warning("the kernel has no dummy devices: %s is a TUN device kept up", DNS_DEVICE)
    return _index(ipr, DNS_DEVICE) or 0, kind


def _dns_addresses(ipr: IPRoute, idx: int, want: list[str]) -> None:
    ensure_sysctl(_iface_key("net.ipv6.conf", DNS_DEVICE, "accept_ra"), "0")
    for addr, plen, _ in _addrs(ipr, idx, 2):
        if (addr, plen) not in [(w, 32) for w in want]:
            ipr.addr("del", index=idx, address=addr, prefixlen=plen)
    for addr, plen, _ in _addrs(ipr, idx, 10):
        if not ipaddress.IPv6Address(addr).is_link_local:
            ipr.addr("del", index=idx, address=addr, prefixlen=plen)
    have = [a for a, _, _ in _addrs(ipr, idx, 2)]
    for w in want:
        if w not in have:
            ipr.addr("add", index=idx, address=w, prefixlen=32)
    ipr.link("set", index=idx, state="up")


def _metadata_table(ipr: IPRoute) -> None:
    for r in ipr.get_routes(family=2, table=METADATA_TABLE):
        if r.get("RTA_DST") == str(METADATA4) and r["type"] == 2:  # RTN_LOCAL
            return
    lo = _index(ipr, "lo")
    ipr.route("replace", dst=f"{METADATA4}/32", type="local", oif=lo, table=METADATA_TABLE,
              scope=254)  # RT_SCOPE_HOST, as every local route is


def prepare_node_sync(ipr: IPRoute, options: NetworkOptions) -> NodeSetup:
    prefix = options.require_network()
    with _step("turn forwarding on"):
        raised = _forwarding(ipr)
    with _step(f"route {prefix} as unreachable"):
        _unreachable(ipr, prefix)
    with _step(f"make {DNS_DEVICE}"):
        idx, kind = _dns_device(ipr)
    with _step(f"give {DNS_DEVICE} the resolver's and OTLP's addresses"):
        _dns_addresses(ipr, idx, [str(options.dns_address), str(options.otlp_address)])
    with _step("route 169.254.169.254 as local for the pods' metadata"):
        _metadata_table(ipr)
    log.info("pods' network: forwarding on, %s unreachable, %s is a %s device",
             prefix, DNS_DEVICE, kind)
    return NodeSetup(kind, raised)


async def prepare_node(options: NetworkOptions, netns: str | None = None) -> NodeSetup:
    """Forwarding, the prefix routed unreachable, feos-dns with its /32s, the metadata table."""
    return await in_thread(netns, prepare_node_sync, options)


# --- the pod's TAP device -------------------------------------------------------------------


@attrs.frozen
class TapSpec:
    """A pod's TAP: its name, owner, and the addresses that route to it.

    owner_uid is the microVM's user (its group has the same number), which owns the device, so
    that a VMM running as that user may open it; None leaves it root's."""

    name: str
    ipv6: ipaddress.IPv6Address
    ipv4: ipaddress.IPv4Address
    dns_address: ipaddress.IPv4Address
    otlp_address: ipaddress.IPv4Address
    owner_uid: int | None = None
    metadata: bool = True  # the node answers 169.254.169.254 on it (QEMU pods)


def _tap_sysctls(name: str) -> list[tuple[str, str]]:
    return [
        (_iface_key("net.ipv6.conf", name, "accept_ra"), "0"),
        (_iface_key("net.ipv6.conf", name, "autoconf"), "0"),
        (_iface_key("net.ipv6.conf", name, "addr_gen_mode"), "1"),
        (_iface_key("net.ipv6.conf", name, "forwarding"), "1"),
        (_iface_key("net.ipv4.conf", name, "arp_ignore"), "1"),
        (_iface_key("net.ipv4.conf", name, "arp_announce"), "2"),
        (_iface_key("net.ipv4.conf", name, "forwarding"), "1"),
        (_iface_key("net.ipv4.neigh", name, "proxy_delay"), "0"),
    ]


def _tap_link(ipr: IPRoute, spec: TapSpec) -> int:
    idx = _index(ipr, spec.name)
    if idx is None:
        create_tuntap(spec.name, IFF_TAP, spec.owner_uid)
        idx = _index(ipr, spec.name)
        if idx is None:
            raise FeosError(Code.INTERNAL, f"{spec.name} is not there after its creation")
    elif spec.owner_uid is not None and _owner_differs(ipr, idx, spec.owner_uid):
        give_tuntap(spec.name, _own_flags(tun_info(ipr, idx)), spec.owner_uid)
    return idx


def _owner_differs(ipr: IPRoute, idx: int, uid: int) -> bool:
    info = tun_info(ipr, idx)
    return (info.get("IFLA_TUN_OWNER"), info.get("IFLA_TUN_GROUP")) != (uid, uid)


def _own_flags(info: dict[str, int]) -> int:
    flags = IFF_TAP | IFF_NO_PI
    flags |= IFF_MULTI_QUEUE if info.get("IFLA_TUN_MULTI_QUEUE") else 0
    return flags | (IFF_VNET_HDR if info.get("IFLA_TUN_VNET_HDR") else 0)


def _tap_addresses(ipr: IPRoute, idx: int, spec: TapSpec) -> None:
    want = [str(spec.dns_address), str(spec.otlp_address)]
    have = [(a, p) for a, p, _ in _addrs(ipr, idx, 2)]
    if have != [(w, 32) for w in want]:  # the resolver's must come first: remove and add anew
        for a, p in have:
            ipr.addr("del", index=idx, address=a, prefixlen=p)
        for w in want:
            ipr.addr("add", index=idx, address=w, prefixlen=32)
    v6 = _addrs(ipr, idx, 10)
    for a, p, _ in v6:
        if (a, p) != (GATEWAY6_CIDR, 64):
            ipr.addr("del", index=idx, address=a, prefixlen=p)
    if not any((a, p) == (GATEWAY6_CIDR, 64) and f & IFA_F_NODAD for a, p, f in v6):
        with contextlib.suppress(NetlinkError):
            ipr.addr("del", index=idx, address=GATEWAY6_CIDR, prefixlen=64)
        ipr.addr("add", index=idx, address=GATEWAY6_CIDR, prefixlen=64, flags=IFA_F_NODAD)


def _tap_neighbour_and_routes(ipr: IPRoute, idx: int, spec: TapSpec) -> None:
    ipr.neigh("replace", dst=str(GATEWAY4), ifindex=idx, flags=NTF_PROXY, family=2)
    ipr.route("replace", dst=f"{spec.ipv6}/128", oif=idx)
    ipr.route("replace", dst=f"{spec.ipv4}/32", oif=idx)
    _metadata_rule(ipr, spec.name, present=spec.metadata)


def _metadata_rules(ipr: IPRoute, name: str) -> list[Any]:
    return [r for r in ipr.get_rules(family=2)
            if r.get("FRA_IIFNAME") == name and r.get("FRA_TABLE") == METADATA_TABLE]


def _metadata_rule(ipr: IPRoute, name: str, *, present: bool) -> None:
    have = _metadata_rules(ipr, name)
    if present and not have:
        ipr.rule("add", family=2, iifname=name, dst=str(METADATA4), dst_len=32,
                 table=METADATA_TABLE, priority=METADATA_RULE_PRIORITY)
    if not present:
        for r in have:
            ipr.rule("del", family=2, iifname=name, dst=str(METADATA4), dst_len=32,
                     table=METADATA_TABLE, priority=r.get("FRA_PRIORITY"))


def make_tap_sync(ipr: IPRoute, spec: TapSpec) -> int:
    with _step(f"create {spec.name}"):
        idx = _tap_link(ipr, spec)
    with _step(f"set {spec.name}'s sysctls"):
        for key, value in _tap_sysctls(spec.name):
            ensure_sysctl(key, value)  # RA, autoconf and link-local off before it goes up
    with _step(f"give {spec.name} its addresses"):
        _tap_addresses(ipr, idx, spec)
    with _step(f"bring {spec.name} up"):
        ipr.link("set", index=idx, state="up")
    with _step(f"route the pod's addresses to {spec.name}"):
        _tap_neighbour_and_routes(ipr, idx, spec)
    verify_tap_sync(ipr, spec)
    return idx


def verify_tap_sync(ipr: IPRoute, spec: TapSpec) -> None:
    """Read the TAP back; a difference is an INTERNAL error naming what differs."""
    idx = _index(ipr, spec.name)
    problems = [] if idx is not None else ["missing"]
    if idx is not None:
        problems += [f"{k}={read_sysctl(k)}" for k, v in _tap_sysctls(spec.name)
                     if read_sysctl(k) != v]
        if [(a, p) for a, p, _ in _addrs(ipr, idx, 2)] != [
                (str(spec.dns_address), 32), (str(spec.otlp_address), 32)]:
            problems.append("IPv4 addresses")
        if [(a, p) for a, p, _ in _addrs(ipr, idx, 10)] != [(GATEWAY6_CIDR, 64)]:
            problems.append("IPv6 addresses")
        if (idx, str(GATEWAY4)) not in proxy_neighbours():
            problems.append("proxy neighbour for 169.254.0.1")
        if bool(_metadata_rules(ipr, spec.name)) != spec.metadata:
            problems.append("metadata rule")
        if spec.owner_uid is not None and _owner_differs(ipr, idx, spec.owner_uid):
            problems.append(f"owner (not uid and gid {spec.owner_uid})")
    if problems:
        raise FeosError(Code.INTERNAL, f"{spec.name} is not as made: {', '.join(problems)}")


def proxy_neighbours() -> set[tuple[int, str]]:
    """(ifindex, address) of the IPv4 proxy entries, by a dump of our own: pyroute2's neighbour
    dump does not set NTF_PROXY in its request, and the kernel lists proxies only for that."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0) as s:
        ndmsg = struct.pack("=BxxxiHBB", socket.AF_INET, 0, 0, NTF_PROXY, 0)
        s.send(struct.pack("=IHHII", 16 + len(ndmsg), 30, 0x301, 1, 0) + ndmsg)  # GETNEIGH, DUMP
        found: set[tuple[int, str]] = set()
        while True:
            data = s.recv(65536)
            for mtype, body in _netlink_messages(data):
                if mtype == 3:  # NLMSG_DONE
                    return found
                if mtype == 28 and len(body) >= 12:  # RTM_NEWNEIGH
                    ifindex = struct.unpack_from("=i", body, 4)[0]
                    for atype, value in _attributes(body[12:]):
                        if atype == 1 and len(value) == 4:  # NDA_DST
                            found.add((ifindex, socket.inet_ntoa(value)))
                elif mtype == 2:  # NLMSG_ERROR
                    raise FeosError(Code.INTERNAL, "the kernel refused a dump of proxy entries")


def _netlink_messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + 16 <= len(data):
        length, mtype = struct.unpack_from("=IH", data, off)
        if length < 16:
            return
        yield mtype, data[off + 16 : off + length]
        off += (length + 3) & ~3


def _attributes(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + 4 <= len(data):
        length, atype = struct.unpack_from("=HH", data, off)
        if length < 4:
            return
        yield atype & 0x3FFF, data[off + 4 : off + length]
        off += (length + 3) & ~3


def delete_tap_sync(ipr: IPRoute, name: str) -> bool:
    """Delete the TAP (its routes and proxy entry go with it) and its metadata rule."""
    _metadata_rule(ipr, name, present=False)
    idx = _index(ipr, name)
    if idx is None:
        return False
    try:
        ipr.link("del", index=idx)
    except NetlinkError as e:
        if e.code != errno.ENODEV:
            raise _translate(f"delete {name}", e) from None
    return True


async def make_tap(spec: TapSpec, netns: str | None = None) -> int:
    """Make (or complete) the pod's TAP device; returns its ifindex."""
    return await in_thread(netns, make_tap_sync, spec)


async def delete_tap(name: str, netns: str | None = None) -> bool:
    """Delete the pod's TAP device; False if there was none."""
    return await in_thread(netns, delete_tap_sync, name)


