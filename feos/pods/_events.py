"""The pods' events: every change of a pod, numbered from 1 per start, to every watcher.

A watcher has a bounded buffer; one that does not keep up loses the oldest of its events and is
told so by a gap in the sequence numbers, so a slow client never holds feosd back.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import attrs
import trio


@attrs.frozen
class PodEvent:
    pod_id: str
    state: str
    reason: str = ""
    step: str = ""
    deleted: bool = False
    sequence: int = 0
    time_unix_ns: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"podId": self.pod_id, "state": self.state, "reason": self.reason,
                "step": self.step, "deleted": self.deleted, "sequence": self.sequence,
                "timeUnixNs": self.time_unix_ns}


IDLE_S = 300.0


class Watcher:
    def __init__(self, hub: EventHub, pod_id: str, size: int) -> None:
        self._hub = hub
        self.pod_id = pod_id
        self.queue: collections.deque[PodEvent] = collections.deque(maxlen=size)
        self.ready = trio.Event()
        self.ended = False
        self.last_read = time.monotonic()

    def offer(self, event: PodEvent) -> None:
        if self.pod_id and event.pod_id != self.pod_id:
            return
        self.queue.append(event)
        self.ready.set()

    async def next(self, params: dict[str, Any]) -> dict[str, Any]:
        """EventStream.next: at least one event, or end once feosd stops."""
        limit = params.get("max", 0) or 256
        self.last_read = time.monotonic()
        while not self.queue and not self.ended:
            self.ready = trio.Event()
            await self.ready.wait()
        events = [self.queue.popleft().to_dict() for _ in range(min(limit, len(self.queue)))]
        return {"events": events, "end": self.ended and not self.queue}

    def close(self) -> None:
        self.ended = True
        self.ready.set()
        self._hub.watchers.discard(self)


class EventHub:
    def __init__(self) -> None:
        self.watchers: set[Watcher] = set()
        self._sequence = 0

    def publish(self, pod_id: str, state: str, *, reason: str = "", step: str = "",
                deleted: bool = False) -> PodEvent:
        self._sequence += 1
        event = PodEvent(pod_id, state, reason, step, deleted, self._sequence, time.time_ns())
        now = time.monotonic()
        for watcher in list(self.watchers):
            if now - watcher.last_read > IDLE_S and watcher.queue:
                watcher.close()  # nobody has read it for minutes: its client is gone
            else:
                watcher.offer(event)
        return event

    def watch(self, pod_id: str = "", size: int = 4096) -> Watcher:
        watcher = Watcher(self, pod_id, size)
        self.watchers.add(watcher)
        return watcher

    def close(self) -> None:
        for watcher in list(self.watchers):
            watcher.close()
