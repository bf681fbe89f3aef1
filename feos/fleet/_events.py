"""The node's events for the control plane: numbered from 1 per start, kept until acknowledged.

Events are added on feosd's runtime (the pods' event hub, feosd's own: started, stopping,
upgrading) and read on the link's thread, so the buffer takes a lock of its own, held for
moments only. It keeps 16,384 events at most: the oldest not acknowledged are dropped and counted,
and the count goes with every Events call. `wake` is called after an add (the uplink sends soon).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

CAPACITY = 16384


@attrs.frozen
class Event:
    sequence: int
    time_unix_ns: int
    kind: str
    pod_id: str = ""
    state: str = ""
    reason: str = ""
    step: str = ""
    deleted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"sequence": self.sequence, "timeUnixNs": self.time_unix_ns, "kind": self.kind,
                "podId": self.pod_id, "state": self.state, "reason": self.reason,
                "step": self.step, "deleted": self.deleted}


class EventBuffer:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._lock = threading.Lock()
        self._events: collections.deque[Event] = collections.deque()
        self._capacity = capacity
        self._next = 1
        self.dropped = 0
        self.acknowledged = 0
        self.wake: Callable[[], None] = lambda: None

    def add(self, kind: str, **fields: Any) -> int:
        with self._lock:
            event = Event(self._next, time.time_ns(), kind, **fields)
            self._next += 1
            self._events.append(event)
            while len(self._events) > self._capacity:
                self._events.popleft()
                self.dropped += 1
        self.wake()
        return event.sequence

    def pending(self, limit: int = 1024) -> list[Event]:
        with self._lock:
            return [e for _, e in zip(range(limit), self._events, strict=False)]

    def count(self) -> int:
        with self._lock:
            return len(self._events)

    def acknowledge(self, upto: int) -> None:
        with self._lock:
            while self._events and self._events[0].sequence <= upto:
                self._events.popleft()
            self.acknowledged = max(self.acknowledged, upto)
