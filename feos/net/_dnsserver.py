"""The pods' resolver on its sockets: a thin trio loop around _dnsresolver.

It owns no sockets' lifetime: DnsSockets come from LISTEN_FDS or bind_dns_sockets and outlive it
(a self-upgrade hands them on). `serve` reports started at once but reads nothing until
`pods_loaded()`: queries wait in the socket buffers and the listen backlog meanwhile. Upstreams are
asked over UDP, one fresh connected socket per attempt (a random port and ID: 32 bits to guess for
an off-path forger), each with its own timeout, in order; a truncated answer is asked again over
TCP. Nothing a client sends ends the server: malformed and oversized input is counted.

The UDP side is the hot one. Each time the socket is readable it reads a batch (recvmmsg through
_dnsmmsg, else recvfrom until the socket is empty), answers what the cache holds from the bytes
(_dnsfast.answer_batch), gives the rest to the slow path (_dnsresolver.decide), sends the batch's
answers at once (sendmmsg) and only then makes the batch's records and hands them to on_record
(or to on_records in one call): trio's scheduler is touched once per batch (after a full batch
the loop reads again after a checkpoint, without wait_readable), and a cached answer costs a
little less CPU than dnsmasq's (docs/network-dns.md, Performance).
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from . import _dnsresolver as r
from ._dnscache import AnswerCache, cache_key
from ._dnsfast import answer_batch, cached_reply, records, slow_cached_reply
from ._dnsmmsg import Batcher, open_batcher
from ._dnsmmsg import load as load_batching
from ._dnsupstream import DEFAULT_UPSTREAMS
from ._listenfds import DnsSockets
from ._nametable import Address, NameTable

MAX_TCP_QUERY = 4096  # a query is a question and an OPT: nothing legitimate comes near it
TCP_IDLE = 10.0
MAX_TCP_CONNECTIONS = 256
MAX_INFLIGHT = 4096
UDP_BATCH = 64
ADDRESSES_KEPT = 4096

_UNKNOWN = r.PodDns("")  # a source not looked up yet in this batch (_udp_batch)

SocketFactory = Callable[[int, int], socket.socket]
Send = Callable[[bytes], Awaitable[None]]


@attrs.define
class DnsCounters:
    udp_queries: int = 0
    tcp_queries: int = 0
    authoritative: int = 0
    forwarded: int = 0
    cache_hits: int = 0
    refused: int = 0
    malformed: int = 0
    dropped: int = 0
    oversized: int = 0
    servfail: int = 0
    upstream_timeouts: int = 0
    upstream_errors: int = 0
    tcp_retries: int = 0
    tcp_connections: int = 0
    tcp_rejected: int = 0
    overloaded: int = 0
    send_errors: int = 0


class DnsServer:
    def __init__(
        self,
        sockets: DnsSockets,
        *,
        pod_for: Callable[[ipaddress.IPv4Address], r.PodDns | None],
        name_tables: Callable[[], Mapping[str, NameTable]],
        on_record: Callable[[r.QueryRecord], None],
        on_records: Callable[[list[r.QueryRecord]], None] | None = None,
        default_upstreams: tuple[Address, ...] = DEFAULT_UPSTREAMS,
        upstream_timeout: float = 2.0,
        upstream_port: int = 53,
        socket_factory: SocketFactory = socket.socket,
        cache: AnswerCache | None = None,
        udp_batching: bool = True,
    ) -> None:
        self._sockets = sockets
        self._pod_for = pod_for
        self._name_tables = name_tables
        self._on_record = on_record
        self._on_records = on_records  # a batch's records in one call, where given
        self._defaults = default_upstreams
        self._timeout = upstream_timeout
        self._port = upstream_port
        self._socket_factory = socket_factory
        self._cache = cache
        self._udp_batching = udp_batching  # recvmmsg/sendmmsg where libc has them (_dnsmmsg)
        self._loaded = trio.Event()
        self._inflight = 0
        self._tcp_open = 0
        self._addresses: dict[str, ipaddress.IPv4Address] = {}
        self.counters = DnsCounters()

    def pods_loaded(self) -> None:
        """Start answering: the pods and their tables are known, so no query is refused wrongly."""
        self._loaded.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        udp = self._sockets.udp
        tcp = trio.socket.from_stdlib_socket(self._sockets.tcp)
        task_status.started()
        batching = self._udp_batching and await trio.to_thread.run_sync(load_batching)
        await self._loaded.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._udp_loop, udp, nursery, batching)
            nursery.start_soon(self._tcp_loop, tcp, nursery)

    # --- the client side ---------------------------------------------------------------------

    async def _udp_loop(self, sock: socket.socket, nursery: trio.Nursery, batching: bool) -> None:
        # The stdlib socket, non-blocking, read until it is empty (or UDP_BATCH) per wake: trio's
        # socket methods cost a checkpoint per call, which would be most of a cached answer's
        # time. wait_readable is the one checkpoint per batch; after a full batch more is likely
        # waiting, so the loop only yields to trio's other tasks and reads again.
        sock.setblocking(False)
        batcher = open_batcher(sock, UDP_BATCH) if batching else None
        while True:
            await trio.lowlevel.wait_readable(sock)
            while (
                self._udp_batch(sock, nursery)
                if batcher is None
                else self._udp_mmsg(batcher, sock, nursery)
            ) >= UDP_BATCH:
                await trio.lowlevel.checkpoint()

    def _udp_mmsg(self, batcher: Batcher, sock: socket.socket, nursery: trio.Nursery) -> int:
        """_udp_batch with one system call to read the batch and one to send its answers, the
        cache's answers made without a Python object but their records (_dnsfast.answer_batch)."""
        count = batcher.read()
        if not count:
            return 0
        now, counters, cache = time.time(), self.counters, self._cache
        done: list[Any] = []

        def slow(i: int, pod: r.PodDns | None, done: list[Any]) -> None:
            answer = self._udp_slow(batcher.datagram(i), batcher.peer(i), pod, now, sock, nursery)
            if answer is not None:
                batcher.queue(i, answer[0])
                done.append(answer[1])

        try:
            if cache is None:
                for i in range(count):
                    slow(i, self._pod_of(batcher.source(batcher.addrs[i])), done)
            else:
                answer_batch(batcher, count, now, self._pod_of, self._defaults, cache, slow, done)
        finally:
            counters.udp_queries += count
            counters.send_errors += batcher.flush()
            made, hits = records(done, now, batcher)
            counters.cache_hits += hits
            self._hand_off(made)
        return count

    def _hand_off(self, made: list[r.QueryRecord]) -> None:
        if self._on_records is not None:
            self._on_records(made)
        else:
            on_record = self._on_record
            for record in made:
                on_record(record)

    def _udp_batch(self, sock: socket.socket, nursery: trio.Nursery) -> int:
        """Answer what waits in the socket, each at once; the records go out after the batch.
        The hot loop: what it calls once per query is bound to locals first."""
        now, counters = time.time(), self.counters
        made: list[r.QueryRecord] = []
        pods: dict[str, r.PodDns | None] = {}  # a source's pod, looked up once per batch
        recvfrom, sendto, append = sock.recvfrom, sock.sendto, made.append
        cache, defaults = self._cache, self._defaults
        queries = hits = 0
        try:
            for _ in range(UDP_BATCH):
                try:
                    data, peer = recvfrom(65535)
                except BlockingIOError:
                    break
                except OSError:
                    continue  # an ICMP error queued on the socket: nothing to answer
                queries += 1
                source = peer[0]
                pod = pods.get(source, _UNKNOWN)
                if pod is _UNKNOWN:
                    pod = pods[source] = self._pod_of(source)
                answer = (
                    None if cache is None else cached_reply(data, source, pod, defaults, cache, now)
                )
                if answer is not None:
                    hits += 1
                elif (answer := self._udp_slow(data, peer, pod, now, sock, nursery)) is None:
                    continue
                try:
                    sendto(answer[0], peer)
                except OSError:
                    counters.send_errors += 1  # the buffer is full: the client retries
                append(answer[1])
        finally:
            counters.udp_queries += queries
            counters.cache_hits += hits
            self._hand_off(made)
        return queries

    def _udp_slow(
        self,
        data: bytes,
        peer: tuple[str, int],
        pod: r.PodDns | None,
        now: float,
        sock: socket.socket,
        nursery: trio.Nursery,
    ) -> tuple[bytes, r.QueryRecord] | None:
        """The slow path of a UDP query: what to send now, or None (dropped, or forwarded)."""
        action = self._act(data, peer[0], pod, "udp", now)
        if isinstance(action, r.Forward):
            self._start_forward(nursery, action, self._udp_sender(sock, peer))
            return None
        return None if action is None else (action.wire, action.record)

    def _udp_sender(self, sock: socket.socket, peer: tuple[str, int]) -> Send:
        async def send(wire: bytes) -> None:
            sock.sendto(wire, peer)  # non-blocking: a full buffer is an OSError, counted

        return send

    async def _tcp_loop(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                conn, peer = await listener.accept()
            except OSError:
                await trio.sleep(0.01)  # out of fds, or a connection reset before accept
                continue
            if self._tcp_open >= MAX_TCP_CONNECTIONS:
                self.counters.tcp_rejected += 1
                conn.close()
                continue
            self.counters.tcp_connections += 1
            nursery.start_soon(self._tcp_connection, conn, peer[0])

    async def _tcp_connection(self, conn: trio.socket.SocketType, source: str) -> None:
        self._tcp_open += 1
        lock = trio.Lock()

        async def send(wire: bytes) -> None:
            async with lock:
                await _send_all(conn, len(wire).to_bytes(2, "big") + wire)

        try:
            async with trio.open_nursery() as nursery:
                while (data := await self._read_tcp_query(conn)) is not None:
                    self.counters.tcp_queries += 1
                    action = self._act(data, source, self._pod_of(source), "tcp", time.time())
                    if isinstance(action, r.Forward):
                        self._start_forward(nursery, action, send)
                    elif action is not None:
                        await self._send(send, action)
        except OSError:
            pass  # the client reset the connection: its answers have nowhere to go
        finally:
            self._tcp_open -= 1
            conn.close()

    async def _read_tcp_query(self, conn: trio.socket.SocketType) -> bytes | None:
        with trio.move_on_after(TCP_IDLE):
            prefix = await _recv_exactly(conn, 2)
            if prefix is None:
                return None
            length = int.from_bytes(prefix, "big")
            if length > MAX_TCP_QUERY:
                self.counters.oversized += 1
                return None
            data = await _recv_exactly(conn, length)
            if data is None:
                self.counters.malformed += 1
            return data
        return None

    def _act(
        self, data: bytes, source: str, pod: r.PodDns | None, transport: r.Transport, now: float
    ) -> r.Reply | r.Forward | None:
        """The slow path: a Reply to send now, a Forward to start, or None (dropped)."""
        action = r.decide(
            data, source, pod, self._name_tables(), self._defaults, transport=transport, now=now
        )
        if isinstance(action, r.Drop):
            self.counters.dropped += 1
            if action.reason.startswith("shorter"):
                self.counters.malformed += 1
            return None
        if isinstance(action, r.Reply):
            self._count(action)
            return action
        if self._cache is not None:
            hit = slow_cached_reply(action, self._cache, now)
            if hit is not None:
                self.counters.cache_hits += 1
                return hit
        if self._inflight >= MAX_INFLIGHT:
            self.counters.overloaded += 1
            return None
        return action

    def _start_forward(self, nursery: trio.Nursery, fwd: r.Forward, send: Send) -> None:
        self._inflight += 1
        nursery.start_soon(self._forward, fwd, send)

    def _pod_of(self, source: str) -> r.PodDns | None:
        address = self._addresses.get(source)
        if address is None:
            try:
                address = ipaddress.IPv4Address(source)
            except ValueError:
                return None
            if len(self._addresses) >= ADDRESSES_KEPT:
                self._addresses.clear()
            self._addresses[source] = address  # parsing one costs more than the whole answer
        return self._pod_for(address)

    def _count(self, reply: r.Reply) -> None:
        rcode = reply.record.rcode
        if rcode == 1:
            self.counters.malformed += 1
        elif rcode == 5:
            self.counters.refused += 1
        elif reply.record.upstream is None and rcode == 0:
            self.counters.authoritative += 1

    async def _send(self, send: Send, reply: r.Reply) -> None:
        try:
            await send(reply.wire)
        except OSError:
            self.counters.send_errors += 1
        self._on_record(reply.record)

    # --- the upstream side -------------------------------------------------------------------

    async def _forward(self, fwd: r.Forward, send: Send) -> None:
        try:
            self.counters.forwarded += 1
            reply = await self._ask_upstreams(fwd)
            if reply is None:
                self.counters.servfail += 1
                reply = r.upstream_failure(fwd, time.time())
            elif self._cache is not None:
                self._cache.put(
                    cache_key(fwd),
                    reply.wire,
                    time.time(),
                    reply.record.upstream,
                    reply.record.answers,
                )
            await self._send(send, reply)
        finally:
            self._inflight -= 1

    async def _ask_upstreams(self, fwd: r.Forward) -> r.Reply | None:
        for upstream in fwd.upstreams:
            ident = secrets.randbelow(65536)
            with trio.move_on_after(self._timeout) as scope:
                try:
                    reply = await self._ask_udp(fwd, upstream, ident)
                    if isinstance(reply, r.Retry):
                        self.counters.tcp_retries += 1
                        reply = await self._ask_tcp(fwd, upstream, ident)
                except OSError:
                    reply = None
                if reply is not None:
                    return reply
                self.counters.upstream_errors += 1
            if scope.cancelled_caught:
                self.counters.upstream_timeouts += 1
        return None

    def _open(self, upstream: Address, kind: int) -> trio.socket.SocketType:
        family = socket.AF_INET6 if upstream.version == 6 else socket.AF_INET
        return trio.socket.from_stdlib_socket(self._socket_factory(family, kind))

    async def _ask_udp(
        self, fwd: r.Forward, upstream: Address, ident: int
    ) -> r.Reply | r.Retry | None:
        with self._open(upstream, socket.SOCK_DGRAM) as sock:
            await sock.connect((str(upstream), self._port))
            await sock.send(r.forward_query(fwd, ident))
            while True:
                data = await sock.recv(65535)
                answer = r.accept_upstream(fwd, ident, upstream, data, time.time())
                if answer is not None:
                    return answer

    async def _ask_tcp(self, fwd: r.Forward, upstream: Address, ident: int) -> r.Reply | None:
        with self._open(upstream, socket.SOCK_STREAM) as sock:
            await sock.connect((str(upstream), self._port))
            query = r.forward_query(fwd, ident)
            await _send_all(sock, len(query).to_bytes(2, "big") + query)
            prefix = await _recv_exactly(sock, 2)
            data = (
                None if prefix is None else await _recv_exactly(sock, int.from_bytes(prefix, "big"))
            )
            if data is None:
                return None
            answer = r.accept_upstream(fwd, ident, upstream, data, time.time(), via_tcp=True)
            return answer if isinstance(answer, r.Reply) else None


async def _recv_exactly(sock: trio.socket.SocketType, n: int) -> bytes | None:
    """n bytes, or None if the peer closed before."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]
