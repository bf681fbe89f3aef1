"""The uplink's pieces without a network: the events' buffer and the token gate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from controlplane_ca import TestCA

from feos.fleet._events import EventBuffer
from feos.fleet._join import TokenGate


def test_events_are_numbered_from_1_and_kept_until_acknowledged() -> None:
    buffer = EventBuffer()
    woken = []
    buffer.wake = lambda: woken.append(1)
    assert [buffer.add("started"), buffer.add("pod", pod_id="p1", state="running")] == [1, 2]
    assert len(woken) == 2
    buffer.acknowledge(1)
    assert [e.sequence for e in buffer.pending()] == [2]
    assert buffer.pending()[0].to_dict()["podId"] == "p1"
    buffer.acknowledge(2)
    assert buffer.count() == 0 and buffer.acknowledged == 2


def test_the_oldest_events_are_dropped_and_counted() -> None:
    buffer = EventBuffer(capacity=4)
    for _ in range(10):
        buffer.add("pod")
    assert [e.sequence for e in buffer.pending()] == [7, 8, 9, 10]
    assert buffer.dropped == 6


def test_a_refused_token_is_not_read_again_until_it_changes(tmp_path: Path) -> None:
    pin = TestCA().pin
    path = tmp_path / "token"
    path.write_text(f"feos-join-one.{pin}\n")
    gate = TokenGate(path)
    got = gate.read()
    assert got is not None and got[1].secret == "one"
    gate.refuse(got[0])
    path.write_text(f"feos-join-one.{pin}")  # the same token rewritten
    assert gate.read() is None
    path.write_text(f"feos-join-two.{pin}")
    again = gate.read()
    assert again is not None and again[1].secret == "two"


def test_a_missing_or_malformed_token_file_waits(tmp_path: Path) -> None:
    gate = TokenGate(tmp_path / "absent")
    assert gate.read() is None
    (tmp_path / "absent").write_text("not a token")
    assert gate.read() is None
