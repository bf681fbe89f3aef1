"""The node's stop during each kind of pod change, over fakes, under trio's autojump clock.

The stop refuses every new change with UNAVAILABLE "feosd stops", lets the one in flight run to
its end within the grace, and only cancels it once the grace is over.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from _podfakes import P1, P2, SPEC, Holds, Node, node, running_pod

from feos.errors import Code, FeosError

GRACE_S = 20.0  # shorter than every change's own deadline: the stop's grace is what ends them
WRITES = ("claim", "put")  # record writes: shielded by their own bound (RECORD_S), past the cut


async def _pod_in(made: Node, state: str) -> None:
    await running_pod(made)
    if state == "stopped":
        await made.pods.stop_pod({"id": P1})
    elif state == "suspended":
        await made.pods.suspend_pod({"id": P1})


def _create(made: Node) -> Awaitable[Any]:
    return made.pods.create_pod({"id": P1, "spec": SPEC})


# kind: (the pod's state before, what is held, the call in flight, the state it ends in)
KINDS: dict[str, tuple[str | None, tuple[str, str], Callable[[Node], Awaitable[Any]], str]] = {
    "create": (None, ("volumes", "claim"), _create, "running"),
    "bring-up": (None, ("vms", "guest"), _create, "running"),
    "start": ("stopped", ("records", "put"), lambda m: m.pods.start_pod({"id": P1}), "running"),
    "stop": ("running", ("vms", "shutdown"), lambda m: m.pods.stop_pod({"id": P1}), "stopped"),
    "delete": ("running", ("vms", "delete"), lambda m: m.pods.delete_pod({"id": P1}), "gone"),
    "suspend": ("running", ("vms", "suspend"), lambda m: m.pods.suspend_pod({"id": P1}),
                "suspended"),
    "resume": ("suspended", ("vms", "resume"), lambda m: m.pods.resume_pod({"id": P1}),
               "running"),
}


async def _in_flight(made: Node, kind: str, nursery: trio.Nursery,
                     outcome: dict[str, Any]) -> Holds:
    before, (who, op), call, _ = KINDS[kind]
    if before is not None:
        await _pod_in(made, before)
    holds: Holds = getattr(made, who)
    holds.hold(op)

    async def caller() -> None:
        try:
            outcome["answer"] = await call(made)
        except FeosError as exc:
            outcome["error"] = exc

    nursery.start_soon(caller)
    await holds.waiting[op].wait()
    return holds


async def _refused(made: Node) -> None:
    for new in (lambda: made.pods.create_pod({"id": P2, "spec": SPEC}),
                lambda: made.pods.stop_pod({"id": P1}),
                lambda: made.pods.delete_pod({"id": P1})):
        with pytest.raises(FeosError) as caught:
            await new()
        assert (caught.value.code, caught.value.message) == (Code.UNAVAILABLE, "feosd stops")


def _settled(made: Node, pod_id: str = P1) -> str:
    return made.state(pod_id) if pod_id in made.records.kept else "gone"


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_change_in_flight_runs_to_its_end_within_the_grace(
        kind: str, tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    outcome: dict[str, Any] = {}
    async with node(tmp_path, monkeypatch) as made, trio.open_nursery() as nursery:
        holds = await _in_flight(made, kind, nursery, outcome)
        made.pods.refuse_changes()
        stopped = trio.Event()

        async def stop() -> None:
            await made.pods.finish_changes(GRACE_S)
            stopped.set()

        nursery.start_soon(stop)
        await _refused(made)
        await trio.sleep(GRACE_S / 2)
        assert not stopped.is_set()  # it waits for the change in flight
        holds.let_go(KINDS[kind][1][1])
        await stopped.wait()
    assert "error" not in outcome, outcome
    assert _settled(made) == KINDS[kind][3]


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_change_past_the_grace_is_cancelled(
        kind: str, tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    outcome: dict[str, Any] = {}
    async with node(tmp_path, monkeypatch) as made, trio.open_nursery() as nursery:
        await _in_flight(made, kind, nursery, outcome)
        made.pods.refuse_changes()
        start = trio.current_time()
        await made.pods.finish_changes(GRACE_S)
        assert trio.current_time() - start >= GRACE_S
        assert made.pods._changes.in_flight() == 0
        await trio.testing.wait_all_tasks_blocked()
    if kind == "bring-up":  # nobody waits for it: the pod stays to be brought up next time
        assert _settled(made) == "pending"
    elif KINDS[kind][1][1] in WRITES:  # the write's wait ends at its own bound, unanswered
        assert outcome["error"].code is Code.UNAVAILABLE, outcome
        assert outcome["error"].message.endswith("was not written within 30s")
    else:
        assert outcome["error"].code is Code.UNAVAILABLE, outcome
        assert outcome["error"].message == "feosd stops"


async def test_the_nodes_own_suspends_pass_the_refusal(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.pods.refuse_changes()
        await made.pods.suspend_for_stop(P1)
        assert _settled(made) == "suspended"
        await _refused(made)
