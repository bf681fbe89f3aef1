"""Traffic records (node.md, "Traffic records"): what the pods do on the network.

Theory of operation. Three sources feed one hub: the conntrack collector (ctnetlink's destroy
events, each a Flow with both directions' packets and bytes and the connection's start and end,
nf_conntrack_acct and nf_conntrack_timestamp turned on), the nflog collector (group 2: drops,
the reason and the pod from the rule's prefix; group 3: the first packets of the TCP connections
pods open, whose TLS server name or HTTP Host becomes a ServerName record), and the resolver
(DnsQuery, which it publishes itself). Every watcher subscribes and gets its own bounded channel;
a record that does not fit is dropped for that watcher and counted in the `missed` of the next
record it gets. The collectors are trio tasks on non-blocking netlink sockets; the sockets are
made on a worker thread that enters the namespace (tests), so the kernel's namespace decides
what they see.

The pods are named by PodDirectory: by the event's addresses, or by the TAP a packet came in on
or went out of. A pod that left is known by its addresses for five minutes more, unless another
pod holds one of them by then, so the ends of connections its deletion cut are still its own.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import trio

from feos.errors import Code, FeosError

from . import _traffic_netlink as nl
from ._links import ensure_sysctl, netns_entered
from ._traffic_parse import NEED_MORE, DropPrefix, http_host, parse_drop_prefix, parse_packet
from ._traffic_parse import tls_server_name as _sni

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
DEPARTED_GRACE = 300.0
DROP_GROUP, SERVER_NAME_GROUP = 2, 3
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NETLINK_NO_ENOBUFS = 270, 1, 5
RCVBUF = 8 * 1024 * 1024


# --- records --------------------------------------------------------------------------------


@attrs.frozen
class Flow:
    pod_id: str
    protocol: int
    src: str
    sport: int
    dst: str
    dport: int
    packets_out: int  # in the connection's original direction
    bytes_out: int
    packets_in: int
    bytes_in: int
    start: float  # seconds since the epoch (0 without timestamps)
    end: float
    missed: int = 0


@attrs.frozen
class Drop:
    pod_id: str
    reason: str
    protocol: int
    src: str
    sport: int
    dst: str
    dport: int
    time: float
    missed: int = 0


@attrs.frozen
class ServerName:
    pod_id: str
    name: str
    kind: str  # "tls" or "http"
    src: str
    dst: str
    dport: int
    time: float
    missed: int = 0


@attrs.frozen
class DnsQuery:
    pod_id: str
    name: str
    qtype: str
    rcode: str
    answers: tuple[str, ...]
    time: float
    missed: int = 0


Record = Flow | Drop | ServerName | DnsQuery


class _Subscriber:
    def __init__(self, capacity: int) -> None:
        self.send, self.receive = trio.open_memory_channel[Record](capacity)
        self.missed = 0

    def offer(self, record: Record) -> None:
        if self.missed:
            record = attrs.evolve(record, missed=record.missed + self.missed)
        try:
            self.send.send_nowait(record)
        except trio.WouldBlock:
            self.missed = record.missed + 1  # this one, and those it would have told of
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        self.missed = 0


class RecordHub:
    """The one channel the sources feed and every watch call streams from (on trio's thread;
    a source on another thread publishes with trio.from_thread.run_sync)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._subs: set[_Subscriber] = set()
        self.lost = 0  # lost on the way to the hub: counted into every watcher's next record

    def publish(self, record: Record) -> None:
        if self.lost:
            record = attrs.evolve(record, missed=record.missed + self.lost)
            self.lost = 0
        for sub in list(self._subs):
            sub.offer(record)

    @property
    def watched(self) -> bool:
        """Whether any watch call streams from the hub: a record made for none goes nowhere."""
        return bool(self._subs)

    def count_lost(self, n: int = 1) -> None:
        self.lost += n

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[trio.MemoryReceiveChannel[Record]]:
        sub = _Subscriber(self.capacity)
        self._subs.add(sub)
        try:
            yield sub.receive
        finally:
            self._subs.discard(sub)
            sub.send.close()


# --- naming the pods ------------------------------------------------------------------------


class PodDirectory:
    """Who holds which address and TAP, and who left with which addresses (and when)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_addr: dict[Address, str] = {}
        self._by_ifindex: dict[int, str] = {}
        self._by_tap: dict[str, str] = {}
        self._departed: dict[Address, tuple[str, float]] = {}
        self._pods: dict[str, tuple[tuple[Address, ...], str | None, int | None]] = {}
        self.resolver: set[Address] = set()

    def add(self, pod_id: str, addresses: Iterable[Address], tap: str | None = None,
            ifindex: int | None = None) -> None:
        addrs = tuple(addresses)
        self.remove(pod_id, forget=True)
        self._pods[pod_id] = (addrs, tap, ifindex)
        for a in addrs:
            self._by_addr[a] = pod_id
            self._departed.pop(a, None)  # another pod holds it now: the one that left lets go
        if tap is not None:
            self._by_tap[tap] = pod_id
        if ifindex is not None:
            self._by_ifindex[ifindex] = pod_id

    def remove(self, pod_id: str, *, forget: bool = False) -> None:
        """The pod left: its addresses name it for DEPARTED_GRACE more (not with forget)."""
        entry = self._pods.pop(pod_id, None)
        if entry is None:
            return
        addrs, tap, ifindex = entry
        until = self.clock() + DEPARTED_GRACE
        for a in addrs:
            if self._by_addr.get(a) == pod_id:
                del self._by_addr[a]
                if not forget:
                    self._departed[a] = (pod_id, until)
        if tap is not None and self._by_tap.get(tap) == pod_id:
            del self._by_tap[tap]
        if ifindex is not None and self._by_ifindex.get(ifindex) == pod_id:
            del self._by_ifindex[ifindex]

    def addresses(self, pod_id: str) -> tuple[Address, ...]:
        return self._pods.get(pod_id, ((), None, None))[0]

    def by_address(self, addr: Address) -> str | None:
        if (pod := self._by_addr.get(addr)) is not None:
            return pod
        gone = self._departed.get(addr)
        if gone is None:
            return None
        if gone[1] <= self.clock():
            del self._departed[addr]
            return None
        return gone[0]

    def by_tap(self, tap: str) -> str | None:
        return self._by_tap.get(tap)

    def by_ifindex(self, ifindex: int) -> str | None:
        return self._by_ifindex.get(ifindex) if ifindex else None


# --- turning events into records (pure) -----------------------------------------------------


def _epoch(ns: int) -> float:
    return ns / 1e9


def flow_record(ev: nl.CtEvent, pods: PodDirectory) -> Flow | None:
    """A destroy event as its pod's Flow, or None: not a pod's, or a query to the resolver."""
    if ev.kind != "destroy":
        return None
    o = ev.orig
    pod = pods.by_address(o.src) or pods.by_address(o.dst)
    if pod is None and ev.reply is not None:
        pod = pods.by_address(ev.reply.dst)  # masqueraded on the way back
    if pod is None:
        return None
    if o.dst in pods.resolver and o.dport == 53:
        return None  # the DNS records cover it
    return Flow(pod, o.protocol, str(o.src), o.sport, str(o.dst), o.dport, ev.packets_orig,
                ev.bytes_orig, ev.packets_reply, ev.bytes_reply, _epoch(ev.start_ns),
                _epoch(ev.stop_ns))


def drop_record(p: nl.LoggedPacket, pods: PodDirectory) -> Drop | None:
    """A packet on the drops' group as its pod's Drop: the prefix names reason and TAP."""
    prefix: DropPrefix = parse_drop_prefix(p.prefix)
    pkt = parse_packet(p.payload)
    pod = pods.by_tap(prefix.tap) if prefix.tap else None
    pod = pod or pods.by_ifindex(p.indev) or pods.by_ifindex(p.outdev)
    if pod is None and pkt is not None:
        pod = pods.by_address(pkt.src) or pods.by_address(pkt.dst)
    if pod is None:
        return None
    when = p.timestamp if p.timestamp is not None else time.time()
    if pkt is None:
        return Drop(pod, prefix.reason, 0, "", 0, "", 0, when)
    return Drop(pod, prefix.reason, pkt.protocol, str(pkt.src), pkt.sport, str(pkt.dst),
                pkt.dport, when)


class ServerNames:
    """The first packets of TCP connections, reassembled per connection up to a limit, until a
    TLS server name or an HTTP Host is found or the stream is neither."""

    MAX_STREAMS = 4096
    MAX_BYTES = 16384

    def __init__(self) -> None:
        self._streams: OrderedDict[tuple[Any, ...], tuple[int, bytes]] = OrderedDict()

    def feed(self, p: nl.LoggedPacket, pods: PodDirectory) -> ServerName | None:
        pkt = parse_packet(p.payload)
        if pkt is None or pkt.protocol != 6 or not pkt.payload:
            return None
        key = (pkt.src, pkt.sport, pkt.dst, pkt.dport)
        held = self._streams.pop(key, None)
        if held is not None and pkt.seq == (held[0] + len(held[1])) & 0xFFFFFFFF:
            seq, data = held[0], held[1] + pkt.payload
        else:
            seq, data = pkt.seq, pkt.payload  # a new stream, or a gap: start from this packet
        return self._try(key, seq, data, pkt, p, pods)

    def _try(self, key: tuple[Any, ...], seq: int, data: bytes, pkt: Any, p: nl.LoggedPacket,
             pods: PodDirectory) -> ServerName | None:
        tls, host = _sni(data), http_host(data)
        name, kind = (tls, "tls") if tls not in (None, NEED_MORE) else (host, "http")
        if name not in (None, NEED_MORE):
            pod = pods.by_address(pkt.src) or pods.by_ifindex(p.indev)
            if pod is None:
                return None
            when = p.timestamp if p.timestamp is not None else time.time()
            return ServerName(pod, str(name), kind, str(pkt.src), str(pkt.dst), pkt.dport, when)
        if NEED_MORE in (tls, host) and len(data) < self.MAX_BYTES:
            self._streams[key] = (seq, data)
            while len(self._streams) > self.MAX_STREAMS:
                self._streams.popitem(last=False)
        return None


# --- sockets --------------------------------------------------------------------------------


def enable_accounting(netns: str | None = None) -> None:
    """nf_conntrack_acct and nf_conntrack_timestamp on (blocking: run on a worker thread).
    They exist once connection tracking is loaded; without, FAILED_PRECONDITION."""
    with netns_entered(netns):
        try:
            ensure_sysctl("net.netfilter.nf_conntrack_acct", "1")
            ensure_sysctl("net.netfilter.nf_conntrack_timestamp", "1")
        except FileNotFoundError:
            raise FeosError(Code.FAILED_PRECONDITION,
                            "connection tracking is not loaded: no traffic records") from None


def open_netfilter_socket(netns: str | None, groups: Iterable[int] = ()) -> socket.socket:
    """A raw NETLINK_NETFILTER socket in `netns`, in the given multicast groups."""
    with netns_entered(netns):
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                          nl.NETLINK_NETFILTER)
    try:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE, as root
        s.bind((0, 0))
        for g in groups:
            s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, g)
    except OSError:
        s.close()
        raise
    return s


def _transact(s: socket.socket, message: bytes, seq: int) -> None:
    """Send one request and wait for its ACK; an error becomes OSError."""
    s.send(message)
    while True:
        for m in nl.messages(s.recv(65536)):
            if m.type == nl.NLMSG_ERROR and m.seq == seq:
                if (code := nl.error_code(m)) != 0:
                    raise OSError(code, f"netlink: {errno.errorcode.get(code, code)}")
                return


def open_nflog(netns: str | None, groups: Iterable[int] = (DROP_GROUP, SERVER_NAME_GROUP),
               copy_range: int = 2048) -> socket.socket:
    """A socket bound to the nflog groups, copying packets (blocking: run on a worker thread)."""
    s = open_netfilter_socket(netns)
    try:
        seq = 1
        for family in (socket.AF_INET, socket.AF_INET6):  # needed before Linux 3.17, harmless
            with contextlib.suppress(OSError):
                _transact(s, nl.nflog_config(seq, 0, nl.NFULNL_CFG_CMD_PF_BIND, family), seq)
            seq += 1
        for g in groups:
            _transact(s, nl.nflog_config(seq, g, nl.NFULNL_CFG_CMD_BIND), seq)
            _transact(s, nl.nflog_config(seq + 1, g, copy_range=copy_range), seq + 1)
            seq += 2
    except OSError:
        s.close()
        raise
    return s


def delete_conntrack_sync(addresses: Iterable[Address], netns: str | None = None) -> int:
    """Delete the conntrack entries whose original source is one of `addresses` (blocking:
    run on a worker thread). Returns how many went; the deletions' events name the pod."""
    wanted = set(addresses)
    s = open_netfilter_socket(netns)
    with s:
        s.send(nl.conntrack_dump(1))
        doomed: list[nl.CtEvent] = []
        done = False
        while not done:
            for m in nl.messages(s.recv(1 << 20)):
                if m.type in (nl.NLMSG_DONE, nl.NLMSG_ERROR):
                    done = True
                elif (ev := nl.decode_conntrack(m)) is not None and ev.orig.src in wanted:
                    doomed.append(ev)
        gone = 0
        for i, ev in enumerate(doomed, start=2):
            try:
                _transact(s, nl.conntrack_delete(ev, i), i)
                gone += 1
            except OSError as e:
                if e.errno != errno.ENOENT:  # it ended meanwhile: fine
                    raise FeosError(Code.UNAVAILABLE, f"delete conntrack entries: {e}") from None
        return gone


async def delete_conntrack(addresses: Iterable[Address], netns: str | None = None) -> int:
    return await trio.to_thread.run_sync(delete_conntrack_sync, list(addresses), netns)


# --- collectors -----------------------------------------------------------------------------


async def _read_loop(sock: socket.socket, hub: RecordHub, handle: Callable[[nl.Message], None]
                     ) -> None:
    while True:
        await trio.lowlevel.wait_readable(sock)
        while True:
            try:
                data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                hub.count_lost()  # the kernel dropped events: how many is not known
                continue
            for m in nl.messages(data):
                handle(m)


class TrafficCollector:
    """The conntrack and nflog collectors, publishing into `hub` what `pods` names."""

    def __init__(self, hub: RecordHub, pods: PodDirectory, netns: str | None = None) -> None:
        self.hub, self.pods, self.netns = hub, pods, netns
        self.names = ServerNames()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        ct = await trio.to_thread.run_sync(open_netfilter_socket, self.netns,
                                           [nl.NFNLGRP_CONNTRACK_DESTROY])
        try:
            log_sock = await trio.to_thread.run_sync(open_nflog, self.netns)
        except OSError:
            ct.close()
            raise
        with ct, log_sock:
            ct.setblocking(False)
            log_sock.setblocking(False)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_loop, ct, self.hub, self._conntrack)
                nursery.start_soon(_read_loop, log_sock, self.hub, self._nflog)
                task_status.started()

    def _conntrack(self, m: nl.Message) -> None:
        ev = nl.decode_conntrack(m)
        if ev is not None and (rec := flow_record(ev, self.pods)) is not None:
            self.hub.publish(rec)

    def _nflog(self, m: nl.Message) -> None:
        p = nl.decode_nflog(m)
        if p is None:
            return
        rec: Record | None = None
        if p.group == DROP_GROUP:
            rec = drop_record(p, self.pods)
        elif p.group == SERVER_NAME_GROUP:
            rec = self.names.feed(p, self.pods)
        if rec is not None:
            self.hub.publish(rec)
