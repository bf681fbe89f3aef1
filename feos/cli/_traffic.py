"""`feosctl traffic watch [POD]`: the pods' traffic records as they come, one a line.

Lines for people (`record_line`), or with --json one TrafficRecord a line (JSON lines, so that a
script reads them as they come). It runs until the node ends the stream or the user stops it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

import capnp

from ..errors import Code, FeosError
from ..rpc import Client, raise_for_status

PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}
QTYPES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA",
          33: "SRV", 64: "SVCB", 65: "HTTPS", 255: "ANY"}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
DEFAULT_BATCH = 256


def _time(ns: int) -> str:
    t = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _proto(n: int) -> str:
    return PROTOCOLS.get(n, str(n))


def _flow(f: dict[str, Any]) -> str:
    seconds = max(0, f.get("endUnixNs", 0) - f.get("startUnixNs", 0)) / 1e9
    return (f"flow {_proto(f.get('protocol', 0))} {f.get('source', '')} -> "
            f"{f.get('destination', '')} out {f.get('packetsOut', 0)}p/{f.get('bytesOut', 0)}B "
            f"in {f.get('packetsIn', 0)}p/{f.get('bytesIn', 0)}B {seconds:.1f}s")


def _drop(d: dict[str, Any]) -> str:
    return (f"drop {d.get('reason', '')} {_proto(d.get('protocol', 0))} "
            f"{d.get('source', '')} -> {d.get('destination', '')}")


def _server_name(s: dict[str, Any]) -> str:
    return f"{s.get('kind', '')} {s.get('name', '')} -> {s.get('destination', '')}"


def _dns(q: dict[str, Any]) -> str:
    qtype = QTYPES.get(q.get("type", 0), f"TYPE{q.get('type', 0)}")
    rcode = RCODES.get(q.get("rcode", 0), str(q.get("rcode", 0)))
    answers = ",".join(q.get("answers", [])) or "-"
    via = q.get("upstream") or "name tables"
    return f"dns {q.get('name', '')} {qtype} {rcode} {answers} via {via}"


_KINDS = {"flow": _flow, "drop": _drop, "serverName": _server_name, "dnsQuery": _dns}


def record_line(rec: dict[str, Any]) -> str:
    """One TrafficRecord (as its dict) as a line: time, pod, what happened."""
    kind = next((k for k in _KINDS if k in rec), None)
    if kind is None:
        return f"{_time(rec.get('timeUnixNs', 0))} - (a record this feosctl does not know)"
    body = rec[kind]
    line = f"{_time(rec.get('timeUnixNs', 0))} {body.get('podId') or '-'} {_KINDS[kind](body)}"
    missed = rec.get("missed", 0)
    return f"{line} (missed {missed} before)" if missed else line


async def traffic_watch(client: Client, args: argparse.Namespace) -> None:
    stream = (await client.call("traffic", "watchTraffic", podId=args.pod or "")).stream
    while True:
        try:
            results = raise_for_status(await stream.next(max=args.batch))
        except capnp.KjException as exc:
            raise FeosError(Code.UNAVAILABLE, f"the traffic stream broke: {exc.description}"
                            ) from exc
        for rec in results.records:
            data = rec.to_dict()
            print(json.dumps(data, sort_keys=True) if args.json else record_line(data))
        sys.stdout.flush()
        if results.end:
            print("feosctl: the node ended the stream (its network stopped)", file=sys.stderr)
            return


def register_traffic(nouns: Any) -> None:
    p = nouns.add_parser("traffic", help="the pods' traffic records",
                         description="the pods' traffic records")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    help = "stream flows, drops, server names and DNS queries as they come (Ctrl-C ends)"
    w = verbs.add_parser("watch", help=help, description=help)
    w.set_defaults(handler=traffic_watch)
    w.add_argument("pod", nargs="?", default="", help="one pod's ID (default: every pod's)")
    w.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"records asked for per call (default {DEFAULT_BATCH})")
