"""feos.fleet's TLSSocket over a socketpair: the handshake (ALPN, the peer's chain for verify), both
ways of data, a peer that does not read (bytes wait in `pending` for `flush`), the peer's
close_notify, a close without one, TLS garbage, and close() waking a task that waits to read."""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trustme
from cryptography import x509

from feos.fleet._tls import TLSSocket
from feos.fleet._verify import peer_chain


def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext, trustme.CA]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("cp.test").configure_cert(server)
    server.set_alpn_protocols(["feos-node/1"])
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    ca.configure_trust(client)
    client.set_alpn_protocols(["feos-node/1"])
    return client, server, ca


def sockets(client_ctx: ssl.SSLContext,
            server_ctx: ssl.SSLContext) -> tuple[TLSSocket, TLSSocket]:
    """A client and a server TLSSocket on the two ends of a socketpair, not yet shaken hands."""
    left, right = socket.socketpair()
    return (TLSSocket(left, client_ctx, server_hostname="cp.test"),
            TLSSocket(right, server_ctx, server_side=True))


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[TLSSocket, TLSSocket]]:
    client_ctx, server_ctx, _ = contexts()
    client, server = sockets(client_ctx, server_ctx)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.handshake)
                await client.handshake()
        yield client, server
    finally:
        client.close()
        server.close()


async def receive_exactly(tls: TLSSocket, size: int) -> bytes:
    got = bytearray()
    with trio.fail_after(10):
        while len(got) < size:
            data = await tls.receive()
            assert data, "the peer ended early"
            got += data
    return bytes(got)


async def test_the_handshake_gives_alpn_and_the_peer_s_chain() -> None:
    async with pair() as (client, _server):
        assert client.selected_alpn_protocol() == "feos-node/1"
        leaf = peer_chain(client.ssl_object)[0]
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == ["cp.test"]


async def test_data_both_ways_and_a_peer_that_does_not_read() -> None:
    async with pair() as (client, server):
        client.write(b"ping")
        assert await receive_exactly(server, 4) == b"ping"
        server.write(b"pong")
        assert await receive_exactly(client, 4) == b"pong"
        big = bytes(range(256)) * 40_000  # 10 MB: more than the socket buffers take
        client.write(big)
        assert client.pending  # the rest waits for flush
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.flush)
            assert await receive_exactly(server, len(big)) == big
        assert not client.pending


async def test_close_notify_is_the_end_and_a_bare_close_is_broken() -> None:
    async with pair() as (client, server):
        await client.aclose()
        with trio.fail_after(10):
            assert await server.receive() == b""
    async with pair() as (client, server):
        client.sock.close()  # no close_notify
        with trio.fail_after(10), pytest.raises(trio.BrokenResourceError):
            await server.receive()


async def test_garbage_instead_of_tls_records_is_broken() -> None:
    async with pair() as (client, server):
        client.sock.send(b"\x17\x03\x03\x00\x10" + b"not a record" * 4)
        with trio.fail_after(10), pytest.raises(trio.BrokenResourceError):
            await server.receive()


async def test_close_wakes_a_task_waiting_to_read() -> None:
    async with pair() as (_client, server):
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                async def read() -> None:
                    with pytest.raises(trio.ClosedResourceError):
                        await server.receive()

                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                server.close()
        with pytest.raises(trio.ClosedResourceError):
            server.write(b"late")


async def test_a_handshake_with_an_untrusted_server_fails() -> None:
    client_ctx, _, _ = contexts()
    _, other_server_ctx, _ = contexts()  # another CA's certificate
    client, server = sockets(client_ctx, other_server_ctx)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                async def serve() -> None:
                    with pytest.raises((ssl.SSLError, trio.BrokenResourceError)):
                        await server.handshake()

                nursery.start_soon(serve)
                with pytest.raises(ssl.SSLCertVerificationError):
                    await client.handshake()
                client.close()
    finally:
        client.close()
        server.close()
