"""recvmmsg/sendmmsg through cffi on real sockets, in a namespace of the test's own: every
datagram read with its source, every answer to where its query came from."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Iterator

import pytest

from conftest import Netns
from feos.net._dnsmmsg import open_batcher

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_netns(ns: Netns) -> Iterator[None]:
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{ns.name}", os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        yield
    finally:
        if _libc.setns(back, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
        os.close(back)
        os.close(there)


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
