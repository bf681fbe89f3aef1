"""TrafficService (schema/network.capnp): every call streams from the records hub.

`watch_traffic({"podId": ...})` subscribes to the hub and returns a TrafficStream capability;
each `next({"max": n})` waits for at least one record (of the pod asked, or of every pod) and
returns up to n, with `end` once the network stopped. A stream the client lets go of
unsubscribes itself (on trio's thread: its destructor may run on the Cap'n Proto thread).
Records that a filter skips pass their `missed` on to the next record the stream returns, so a
watcher of one pod still learns that records were lost. `record_dict` is the wire form, pure.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable
from typing import Any

import attrs
import trio

from feos._codec import takes
from feos.errors import Code, FeosError, invalid

from ._links import tap_name
from ._traffic import DnsQuery, Drop, Flow, Record, RecordHub, ServerName

DEFAULT_MAX = 256
MAX_MAX = 4096
_NS = 1_000_000_000


def _endpoint(addr: str, port: int) -> str:
    """ADDRESS:PORT, an IPv6 address in brackets; without a port (ICMP) the address alone."""
    try:
        six = ipaddress.ip_address(addr).version == 6
    except ValueError:
        return addr
    host = f"[{addr}]" if six else addr
    return f"{host}:{port}" if port else addr


def _ns(seconds: float) -> int:
    return round(seconds * _NS)


def record_dict(rec: Record) -> dict[str, Any]:
    """One record as a TrafficRecord of the schema (camelCase dict)."""
    if isinstance(rec, Flow):
        return {"timeUnixNs": _ns(rec.end or rec.start), "missed": rec.missed, "flow": {
            "podId": rec.pod_id, "protocol": rec.protocol,
            "source": _endpoint(rec.src, rec.sport),
            "destination": _endpoint(rec.dst, rec.dport),
            "bytesOut": rec.bytes_out, "bytesIn": rec.bytes_in,
            "packetsOut": rec.packets_out, "packetsIn": rec.packets_in,
            "startUnixNs": _ns(rec.start), "endUnixNs": _ns(rec.end), "event": "destroy"}}
    if isinstance(rec, Drop):
        return {"timeUnixNs": _ns(rec.time), "missed": rec.missed, "drop": {
            "podId": rec.pod_id, "reason": rec.reason, "protocol": rec.protocol,
            "source": _endpoint(rec.src, rec.sport),
            "destination": _endpoint(rec.dst, rec.dport)}}
    if isinstance(rec, ServerName):
        return {"timeUnixNs": _ns(rec.time), "missed": rec.missed, "serverName": {
            "podId": rec.pod_id, "name": rec.name, "kind": rec.kind,
            "destination": _endpoint(rec.dst, rec.dport)}}
    if isinstance(rec, DnsQuery):
        return {"timeUnixNs": _ns(rec.time), "missed": rec.missed, "dnsQuery": {
            "podId": rec.pod_id, "name": rec.name,
            "type": getattr(rec, "qtype_number", 0), "rcode": getattr(rec, "rcode_number", 0),
            "answers": list(rec.answers), "upstream": getattr(rec, "upstream", "")}}
    raise TypeError(f"not a traffic record: {rec!r}")


@attrs.frozen
class NextParams:
    max: int = 0


@attrs.frozen
class WatchTraffic:
    pod_id: str = ""


class TrafficStream:
    """One watcher's subscription to the hub."""

    def __init__(self, hub: RecordHub, pod_id: str) -> None:
        self.pod_id = pod_id
        self._subscription = hub.subscribe()
        self._rx: trio.MemoryReceiveChannel[Record] = self._subscription.__enter__()
        self._token = trio.lowlevel.current_trio_token()
        self._skipped_missed = 0
        self.closed = False

    @takes(NextParams)
    async def next(self, call: NextParams) -> dict[str, Any]:
        limit = min(max(call.max or DEFAULT_MAX, 1), MAX_MAX)
        records: list[Record] = []
        end = False
        while not records and not end:
            try:
                self._take(await self._rx.receive(), records)
            except (trio.EndOfChannel, trio.ClosedResourceError):
                end = True
            while len(records) < limit and not end:
                try:
                    self._take(self._rx.receive_nowait(), records)
                except trio.WouldBlock:
                    break
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    end = True
        if end:
            self.close()
        return {"records": [record_dict(r) for r in records], "end": end}

    def _take(self, rec: Record, into: list[Record]) -> None:
        if self.pod_id and rec.pod_id != self.pod_id:
            self._skipped_missed += rec.missed
            return
        if self._skipped_missed:
            rec = _with_missed(rec, rec.missed + self._skipped_missed)
            self._skipped_missed = 0
        into.append(rec)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._subscription.__exit__(None, None, None)

    def __del__(self) -> None:
        if not self.closed:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.close)


def _with_missed(rec: Record, missed: int) -> Record:
    return attrs.evolve(rec, missed=missed)


class TrafficService:
    """feos.network.v1.TrafficService: `watch_traffic`, in the API server's dict convention."""

    def __init__(self, hub: RecordHub,
                 unavailable: Callable[[], str | None] = lambda: None) -> None:
        self.hub = hub
        self._unavailable = unavailable

    def open_stream(self, pod_id: str = "") -> TrafficStream:
        """A subscription for trio code (and the tests); watch_traffic wraps it as a capability."""
        if pod_id:
            try:
                tap_name(pod_id)
            except FeosError:
                raise invalid("podId", "must be a pod's ID (11 characters or a UUID)") from None
        reason = self._unavailable()
        if reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION, reason)
        return TrafficStream(self.hub, pod_id)

    @takes(WatchTraffic)
    async def watch_traffic(self, call: WatchTraffic) -> dict[str, Any]:
        from feos import _schema
        from feos.rpc import Cap

        stream = self.open_stream(call.pod_id)
        return {"stream": Cap(_schema.network().TrafficStream, stream)}
