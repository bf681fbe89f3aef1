"""The link's part on feosd's runtime (feos.fleet._link.Runtime): the pods' events forwarded, a
report's collection waited for a second at most, the 90 s rule."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from feos.fleet import EventBuffer, Runtime
from feos.pods._events import EventHub


class Pods:
    """The pod service's two parts the runtime uses: its event hub and ListPods."""

    def __init__(self) -> None:
        self.events = EventHub()
        self.stall = trio.Event()
        self.stall.set()

    async def list_pods(self, params: dict[str, Any]) -> dict[str, Any]:
        await self.stall.wait()
        return {"pods": [{"id": "p1", "state": "running", "containers": [{"name": "c"}]}]}


class Host:
    async def get_host_info(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"info": {"hostname": "n1", "version": {"feosd": "0.1.0"}}}


async def test_pod_events_reach_the_buffer(tmp_path: Path) -> None:
    pods = Pods()
    runtime = Runtime(pods=pods, host=Host(), events=EventBuffer(), mesh_dir=tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        added = trio.Event()
        runtime.events.wake = added.set
        await trio.lowlevel.checkpoint()  # the forwarder watches the hub
        pods.events.publish("p1", "running", reason="started")
        with trio.fail_after(5):
            await added.wait()
        event = runtime.events.pending()[0]
        assert (event.kind, event.pod_id, event.state, event.reason) == ("pod", "p1", "running",
                                                                         "started")
        nursery.cancel_scope.cancel()


async def test_a_report_waits_a_second_at_most_and_the_90s_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pods = Pods()
    runtime = Runtime(pods=pods, host=Host(), events=EventBuffer(), mesh_dir=tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        fresh = await runtime.telemetry()
        assert [p["id"] for p in fresh["pods"]] == ["p1"] and "containers" not in fresh["pods"][0]
        assert fresh["versions"] == {"feosd": "0.1.0"} and fresh["podsUnixNs"] > 0
        pods.stall = trio.Event()  # the pods stop answering
        began = trio.current_time()
        stale = await runtime.telemetry()
        assert 0.9 < trio.current_time() - began < 3
        assert stale["podsUnixNs"] == fresh["podsUnixNs"]  # as they were
        assert runtime.health() is None
        runtime.held_s = 0.5
        runtime.last_tick = time.monotonic()  # the tick is fine: the pods alone hold reports
        assert "the pods have not answered" in (runtime.health() or "")
        pods.stall.set()
        again = await runtime.telemetry()  # the pending collection ends, as the pods answer
        assert again["podsUnixNs"] > fresh["podsUnixNs"]
        runtime.last_tick = time.monotonic()
        assert runtime.health() is None
        runtime.last_tick -= 1
        assert "has not ticked" in (runtime.health() or "")
        nursery.cancel_scope.cancel()
