"""feosctl pod hibernate / restore: a pod into the object store and back, with its progress."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..errors import Code, FeosError
from ..rpc import Client
from ._commands import Table, _verb, load_file
from ._pods import POD_COLUMNS, Progress, pod_row, wait_settled

POLL_S = 0.5


def _bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


async def _follow(client: Client, pod_id: str, progress: Progress) -> None:
    """GetPod's hibernation twice a second: a line a phase, and the bytes as they move."""
    shown = ""
    while True:
        await asyncio.sleep(POLL_S)
        try:
            pod = (await client.call("pods", "getPod", id=pod_id)).pod.to_dict()
        except FeosError:
            continue
        h = pod.get("hibernation") or {}
        if not h:
            continue
        line = h.get("phase", "")
        if h.get("bytesTotal"):
            line += f" {_bytes(h.get('bytesDone', 0))} of {_bytes(h['bytesTotal'])}"
        if line != shown:
            shown = line
            progress.line(line)


async def pod_hibernate(client: Client, args: argparse.Namespace) -> Table:
    progress = Progress(args.id, args.json)
    follow = asyncio.ensure_future(_follow(client, args.id, progress))
    try:
        r = await client.call("pods", "hibernatePod", id=args.id, noAbandon=args.no_abandon)
    finally:
        follow.cancel()
    pod = r.pod.to_dict()
    progress.settled(pod.get("state", ""), pod.get("checkpoint", ""))
    return Table(pod, POD_COLUMNS, [pod_row(pod)])


async def pod_restore(client: Client, args: argparse.Namespace) -> Table:
    params: dict[str, Any] = {"id": args.id, "checkpoint": args.checkpoint}
    if args.file:
        spec = load_file(args.file)
        if not isinstance(spec, dict):
            raise FeosError(Code.INVALID_ARGUMENT, f"{args.file}: a pod spec is a mapping")
        params["spec"] = spec.get("spec", spec)  # a spec, or a document of {id, spec}
    progress = Progress(args.id, args.json)
    progress.line("restoring")
    pod = (await client.call("pods", "restorePod", **params)).pod.to_dict()
    if pod.get("state") == "pending":
        pod = await wait_settled(client, args.id, args.json)
    progress.settled(pod.get("state", ""), pod.get("reason", ""))
    return Table(pod, POD_COLUMNS, [pod_row(pod)])


def register(verbs: Any) -> None:
    p = _verb(verbs, "hibernate", pod_hibernate,
             "freeze a pod into the object store as a checkpoint, with its progress")
    p.add_argument("id")
    p.add_argument("--no-abandon", action="store_true",
                   help="a resume meanwhile waits for it and restores, rather than abandon it")
    p = _verb(verbs, "restore", pod_restore,
             "take a checkpoint over on this node (the pod of the same ID) and run it")
    p.add_argument("id")
    p.add_argument("checkpoint", help="the checkpoint's reference (sha256:...)")
    p.add_argument("-f", "--file", help="the pod's spec for this node (default: the checkpoint's)")

