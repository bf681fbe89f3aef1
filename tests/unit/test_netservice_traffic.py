"""TrafficService: records in the schema's form, a stream's filter, its missed count and its end,
and the whole of it over Cap'n Proto RPC through the API server's mapping."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from feos import _schema
from feos.errors import Code, FeosError
from feos.net._traffic import Drop, Flow, RecordHub, ServerName
from feos.net._traffic_service import TrafficService, record_dict
from feos.rpc import capnp_thread
from feos.rpc._server import serve

A, B = "abcdefghjkm", "bcdefghjkmn"


def flow(pod: str, missed: int = 0) -> Flow:
    return Flow(pod, 6, "169.254.16.2", 40000, "2001:db8::1", 443, 3, 180, 2, 120, 10.0, 12.5,
                missed)


def test_records_fit_the_schema() -> None:
    net = _schema.network()
    recs = [
        flow(A),
        Drop(A, "deny", 17, "169.254.16.2", 5353, "10.0.0.1", 53, 3.0),
        Drop(A, "no-rule", 1, "169.254.16.2", 0, "10.0.0.1", 0, 3.0),
        ServerName(A, "example.com", "tls", "169.254.16.2", "192.0.2.1", 443, 4.0),
    ]
    got = [net.TrafficRecord.new_message(**record_dict(r)).to_dict() for r in recs]
    f = got[0]["flow"]
    assert (f["source"], f["destination"]) == ("169.254.16.2:40000", "[2001:db8::1]:443")
    assert (f["bytesOut"], f["bytesIn"], f["packetsOut"], f["packetsIn"]) == (180, 120, 3, 2)
    assert (f["startUnixNs"], f["endUnixNs"], got[0]["timeUnixNs"]) == (
        10_000_000_000, 12_500_000_000, 12_500_000_000)
    assert got[1]["drop"] == {"podId": A, "reason": "deny", "protocol": 17,
                              "source": "169.254.16.2:5353", "destination": "10.0.0.1:53"}
    assert got[2]["drop"]["destination"] == "10.0.0.1"  # ICMP has no port
    assert got[3]["serverName"] == {"podId": A, "name": "example.com", "kind": "tls",
                                    "destination": "192.0.2.1:443"}


async def test_a_stream_of_one_pod_keeps_the_missed_of_others() -> None:
    hub = RecordHub()
    svc = TrafficService(hub)
    stream = svc.open_stream(A)
    hub.publish(flow(B, missed=2))  # someone else's, telling of 2 lost
    hub.publish(flow(A))
    hub.publish(flow(A))
    out = await stream.next({"max": 1})
    assert [r["flow"]["podId"] for r in out["records"]] == [A] and not out["end"]
    assert out["records"][0]["missed"] == 2
    out = await stream.next({})
    assert [r["missed"] for r in out["records"]] == [0]
    stream.close()
    assert not hub._subs


async def test_next_waits_for_a_record_and_ends_with_the_hub() -> None:
    hub = RecordHub()
    stream = TrafficService(hub).open_stream()
    got: list[Any] = []

    async def watch() -> None:
        got.append(await stream.next({"max": 10}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing yet: it waits
        hub.publish(flow(B))
    assert [r["flow"]["podId"] for r in got[0]["records"]] == [B]
    for sub in list(hub._subs):
        sub.send.close()  # the network stops
    assert await stream.next({}) == {"records": [], "end": True}


def test_watch_refuses_a_bad_id_and_an_unavailable_network() -> None:
    with pytest.raises(FeosError) as e:
        TrafficService(RecordHub()).open_stream("NOT-AN-ID")
    assert e.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(FeosError) as e:
        TrafficService(RecordHub(), lambda: "no --pod-prefix").open_stream()
    assert e.value.code == Code.FAILED_PRECONDITION


async def test_over_capnp_rpc() -> None:
    """watchTraffic returns a capability; its next() waits and returns records."""
    net = _schema.network()
    hub = RecordHub()
    svc = TrafficService(hub)
    server_sock, client_sock = socket.socketpair()
    async with capnp_thread() as bridge:

        async def start_server() -> Any:
            import capnp

            stream = await capnp.AsyncIoStream.create_connection(sock=server_sock)
            return capnp.TwoPartyServer(stream, bootstrap=serve(net.TrafficService, svc, bridge))

        async def call_client() -> tuple[Any, Any]:
            import capnp

            stream = await capnp.AsyncIoStream.create_connection(sock=client_sock)
            client = capnp.TwoPartyClient(stream)
            traffic = client.bootstrap().cast_as(net.TrafficService)
            watched = await traffic.watchTraffic(podId=A)
            first = await watched.stream.next(max=5)
            bad = await traffic.watchTraffic(podId="NOPE")
            return first.to_dict(), (str(bad.status.code), client)

        server = await bridge.call(start_server)

        async def publish_later() -> None:
            with trio.fail_after(10):  # until the client's next() waits (on the Cap'n Proto thread)
                while not any(sub.send.statistics().tasks_waiting_receive for sub in hub._subs):  # noqa: ASYNC110
                    await trio.sleep(0.001)
            hub.publish(flow(B))
            hub.publish(flow(A))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_later)
            first, (bad_code, client) = await bridge.call(call_client)

        async def close() -> None:
            client.close()
            server.close()

        await bridge.call(close)
    assert [r["flow"]["podId"] for r in first["records"]] == [A]
    assert first.get("end", False) is False
    assert bad_code == "invalidArgument"
    server_sock.close()
    client_sock.close()
