"""recvmmsg/sendmmsg through feos._native on real sockets, in a namespace of the test's own: every
datagram read with its source, every answer to where its query came from."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import itertools
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Netns
from feos import native
from feos.net import _dnsfast
from feos.net import _dnsmsg as m
from feos.net import _dnsresolver as r
from feos.net._dnscache import AnswerCache, cache_key
from feos.net._dnsfast import answer_batch, cached_reply, records
from feos.net._dnsmmsg import open_batcher
from feos.net._links import netns_entered

pytestmark = pytest.mark.skipif(
    not native.available(), reason="feos._native is not built: python native/build.py"
)


def in_netns(ns: Netns) -> contextlib.AbstractContextManager[None]:
    """This thread in the namespace for the block: sockets made in it stay there."""
    return netns_entered(ns.name)


@pytest.fixture
def server_and_clients(netns: Netns) -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    with in_netns(netns):
        server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(5)]
    try:
        server.bind(("127.0.0.1", 0))
        server.setblocking(False)
        for i, c in enumerate(clients):
            c.bind((f"127.0.0.{i + 2}", 0))
            c.settimeout(5)
        yield server, clients
    finally:
        server.close()
        for c in clients:
            c.close()


def test_every_datagram_and_its_source_and_every_answer_back(
    server_and_clients: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = server_and_clients
    batcher = open_batcher(server, batch=16)
    assert batcher is not None
    assert batcher.receive() == []  # nothing waits yet
    sent = {}
    for n in range(40):  # more than a batch: read in three
        c = clients[n % len(clients)]
        data = bytes([n]) * (n * 37 % 1500) + n.to_bytes(2, "big")
        c.sendto(data, server.getsockname())
        sent[data] = c.getsockname()
    big = b"\x07" * 65507  # the most one IPv4 datagram carries: not cut
    clients[0].sendto(big, server.getsockname())
    sent[big] = clients[0].getsockname()
    answered: dict[tuple[str, int], list[bytes]] = {}
    while sum(map(len, answered.values())) < len(sent):
        batch = batcher.receive()  # answered before the next is read: the addresses are reused
        assert 0 < len(batch) <= 16, "a datagram sent was not read"
        for i, (data, source) in enumerate(batch):
            assert source == sent[data][0]
            assert batcher.peer(i) == sent[data]
            batcher.queue(i, data[::-1])
            answered.setdefault(sent[data], []).append(data[::-1])
        assert batcher.flush() == 0
    assert sorted(d for batch in answered.values() for d in batch) == sorted(d[::-1] for d in sent)
    for c in clients:
        want = answered[c.getsockname()]
        got = [c.recv(65535) for _ in want]
        assert got == want  # each to its own source, in order
    assert batcher.receive() == []


def test_an_empty_datagram_and_a_flush_of_nothing(
    server_and_clients: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = server_and_clients
    batcher = open_batcher(server)
    assert batcher is not None
    assert batcher.flush() == 0
    clients[1].sendto(b"", server.getsockname())
    [(data, source)] = batcher.receive()
    assert (data, source) == (b"", "127.0.0.3")
    batcher.queue(0, b"x" * 65537)  # more than a datagram holds: counted, not sent
    batcher.queue(0, b"x" * 3000)
    assert batcher.flush() == 1
    assert batcher.flush() == 0
    assert clients[1].recv(4096) == b"x" * 3000


def test_only_ipv4_datagram_sockets_are_batched(netns: Netns) -> None:
    with in_netns(netns):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    with tcp, udp6:
        assert open_batcher(tcp) is None
        assert open_batcher(udp6) is None


# --- the hot path of the batch (_dnsfast.answer_batch) against cached_reply, query by query ----

UP = (ipaddress.ip_address("198.51.100.53"),)
OWN = (ipaddress.ip_address("192.0.2.53"),)
PODS = {"127.0.0.2": r.PodDns("pod-a"), "127.0.0.3": r.PodDns("pod-b", (), OWN)}  # else strangers
NAMES = ("www.example.test", "a.b", "db", "Mixed.Case.test")


def query(name: str, qtype: int, ident: int, flags: int, opt: int | None) -> bytes:
    additionals = () if opt is None else (m.Record((), m.OPT, opt, 0, b""),)
    q = (m.Question(tuple(p.encode() for p in name.split(".") if p), qtype),)
    return m.build_message(m.Message(ident, flags, q, (), (), additionals))


def fill(caches: list[AnswerCache], count: int) -> None:
    """The same answers in each cache, in the same order: every name and type, both pods'
    upstreams, with and without an OPT; `count` records of 4 bytes each, TTLs 20 to 79 s."""
    for name in NAMES:
        for qtype, pod, opt in itertools.product((m.A, m.AAAA), PODS.values(), (None, 1232)):
            data = query(name.lower(), qtype, 1, m.RD, opt)
            fwd = r.decide(data, "127.0.0.2", pod, {}, UP, transport="tcp", now=100.0)
            assert isinstance(fwd, r.Forward)
            lower = tuple(x.lower() for x in fwd.query.questions[0].name)
            answers = tuple(
                m.Record(lower, qtype, 1, 20 + (len(name) * n + qtype) % 60, bytes([192, 0, 2, n]))
                for n in range(count)
            )
            extra = () if opt is None else (m.Record((), m.OPT, 1232, 0, b""),)
            question = (m.Question(lower, qtype),)
            wire = m.build_message(m.Message(7, m.QR | m.RD | m.RA, question, answers, (), extra))
            reply = r.accept_upstream(fwd, 7, fwd.upstreams[0], wire, 100.0, via_tcp=True)
            assert isinstance(reply, r.Reply)
            for cache in caches:
                cache.put(cache_key(fwd), reply.wire, 100.0, "up", reply.record.answers)


queries = st.tuples(
    st.sampled_from(NAMES),
    st.integers(0, 2**16 - 1),  # which letters are upper case
    st.sampled_from([m.A, m.AAAA, m.AAAA, m.MX]),
    st.integers(0, 0xFFFF),
    st.sampled_from([m.RD, m.RD, m.RD, 0, m.QR]),
    st.sampled_from([None, None, 1232, 512]),
    st.integers(0, 3),  # the client, of which two are pods
    st.booleans(),  # asked over TCP first: what the hot item keeps then is not for UDP
)


def test_the_batch_gives_what_cached_reply_gives_query_by_query(
    server_and_clients: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = server_and_clients
    batcher = open_batcher(server, batch=64)
    assert batcher is not None
    seen = {"hits": 0, "slow": 0}

    @settings(max_examples=150, deadline=None)
    @given(
        st.lists(queries, min_size=16, max_size=64),
        st.floats(99.0, 125.0),
        st.sampled_from([0.0, 0.3, 1.0, 2.5, 30.0, -0.6]),  # the same queries again then
        st.integers(1, 90) | st.integers(1, 3),
    )
    def check(asked: list[Any], now: float, later: float, count: int) -> None:
        _dnsfast._hot.clear()  # what the last example kept may not match this one's caches
        caches = [AnswerCache(), AnswerCache()]
        fill(caches, count)
        sent = []
        for name, upper, qtype, ident, flags, opt, c, tcp in asked:
            spelled = "".join(ch.upper() if upper >> k & 1 else ch for k, ch in enumerate(name))
            data = query(spelled, qtype, ident, flags, opt)
            source = clients[c].getsockname()[0]
            for cache in caches[::-1] if tcp else ():  # the hot items then hold the batch's cache's
                cached_reply(data, source, PODS.get(source), UP, cache, now, "tcp")
            sent.append((data, clients[c], source))
        got = [batch(sent, caches[0], at) for at in (now, now + later)]
        for at, (answers, made, hits) in zip((now, now + later), got, strict=True):
            wanted = [cached_reply(d, s, PODS.get(s), UP, caches[1], at) for d, _, s in sent]
            assert answers == [b"slow %d" % i if w is None else w[0] for i, w in enumerate(wanted)]
            assert made == [i if w is None else w[1] for i, w in enumerate(wanted)]
            assert hits == sum(1 for w in wanted if w is not None)
            seen["hits"] += hits
            seen["slow"] += len(sent) - hits
        assert list(caches[0]._entries) == list(caches[1]._entries)  # the same LRU order

    def batch(
        sent: list[Any], cache: AnswerCache, now: float
    ) -> tuple[list[bytes], list[Any], int]:
        """The queries sent and read as one batch, answered at `now`: what each client got."""
        for data, client, _ in sent:
            client.sendto(data, server.getsockname())
        assert batcher.read() == len(sent)
        done: list[Any] = []

        def slow(i: int, pod: r.PodDns | None, done: list[Any]) -> None:
            assert pod is PODS.get(batcher.source(batcher.addrs[i]))
            batcher.queue(i, b"slow %d" % i)
            done.append(i)

        answer_batch(batcher, len(sent), now, PODS.get, UP, cache, slow, done)
        assert batcher.flush() == 0
        made, hits = records(done, now, batcher)
        return [client.recv(65535) for _, client, _ in sent], made, hits

    check()
    assert seen["hits"] > 300 and seen["slow"] > 300, seen  # both paths taken, often


def test_a_batch_sends_each_query_its_own_answer_after_what_made_them_is_dropped(
    server_and_clients: tuple[socket.socket, list[socket.socket]],
) -> None:
    # The same questions from two pods of different upstreams in one batch (one hot item,
    # bound to each pod's key in turn), and then everything the answers were made from let go
    # before the flush: the kept items, the records, the cache's entries, their memory reused.
    # Each client still gets the answer cached_reply gives it, byte for byte.
    server, clients = server_and_clients
    batcher = open_batcher(server, batch=64)
    assert batcher is not None
    caches = [AnswerCache(), AnswerCache()]
    fill(caches, 3)
    sent = []
    for n in range(60):
        name = NAMES[n % len(NAMES)]
        data = query(name.upper() if n % 3 else name, (m.A, m.AAAA)[n % 2], n, m.RD, None)
        c = n % 4  # two pods, two strangers
        sent.append((data, clients[c], clients[c].getsockname()[0]))
    _dnsfast._hot.clear()
    wanted = [cached_reply(d, s, PODS.get(s), UP, caches[1], 110.0) for d, _, s in sent]
    assert sum(w is not None for w in wanted) > 20
    _dnsfast._hot.clear()
    for data, client, _ in sent:
        client.sendto(data, server.getsockname())
    assert batcher.read() == len(sent)
    done: list[Any] = []

    def slow(i: int, pod: r.PodDns | None, done: list[Any]) -> None:
        batcher.queue(i, b"slow %d" % i)

    answer_batch(batcher, len(sent), 110.0, PODS.get, UP, caches[0], slow, done)
    done.clear()
    _dnsfast._hot.clear()
    caches[0]._entries.clear()
    gc.collect()
    churn = [bytes([n % 251]) * size for size in range(40, 400, 7) for n in range(50)]
    assert batcher.flush() == 0
    del churn
    got = [client.recv(65535) for _, client, _ in sent]
    assert got == [b"slow %d" % i if w is None else w[0] for i, w in enumerate(wanted)]
