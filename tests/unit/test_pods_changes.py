"""The pod changes' rules over fakes: callers that go, stops of bring-ups, races, a new pod of an
old ID, record writes that run out of time; under trio's autojump clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from _podfakes import P1, SPEC, FakeRecords, node, running_pod

from feos.errors import Code, FeosError
from feos.pods import _changes


async def test_a_caller_that_goes_away_leaves_its_change_running(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.vms.hold("shutdown")
        with trio.move_on_after(1):  # the caller's deadline
            await made.pods.stop_pod({"id": P1})
        await made.vms.waiting["shutdown"].wait()
        made.vms.let_go("shutdown")
        await made.pods._changes.wait_idle()
        assert made.state(P1) == "stopped"


async def test_a_stop_ends_a_bring_up_and_the_pod_stops(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        made.vms.hold("guest")  # the guest never attaches
        await made.pods.create_pod({"id": P1, "spec": SPEC})
        await made.vms.waiting["guest"].wait()
        answer = await made.pods.stop_pod({"id": P1})
        assert answer["pod"]["state"] == "stopped"
        bringup = made.pods._pods[P1].bringup
        assert bringup is not None and bringup.done.is_set()
        assert made.state(P1) == "stopped"
        assert made.records.kept[P1]["reason"] == "stopped by a call"
        assert "shutdown" in made.vms.calls


async def test_a_bring_up_past_its_deadline_fails_the_pod(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        made.vms.hold("create")  # the microVM is never made
        start = trio.current_time()
        await made.pods.create_pod({"id": P1, "spec": SPEC})
        bringup = made.pods._pods[P1].bringup
        assert bringup is not None
        await bringup.done.wait()
        assert made.state(P1) == "failed"
        assert "did not end within" in made.records.kept[P1]["reason"]
        assert trio.current_time() - start == pytest.approx(_changes.bring_up_s(60.0))


async def test_a_change_waiting_on_a_deleted_pod_does_not_act_on_its_successor(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.vms.hold("delete")
        outcome: dict[str, Any] = {}

        async def suspend() -> None:
            try:
                await made.pods.suspend_pod({"id": P1})
            except FeosError as exc:
                outcome["error"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(made.pods.delete_pod, {"id": P1})
            await made.vms.waiting["delete"].wait()
            nursery.start_soon(suspend)  # waits for the old pod's lock
            await trio.testing.wait_all_tasks_blocked()
            made.vms.let_go("delete")
        await running_pod(made)  # the same ID, a new pod
        assert outcome["error"].code is Code.NOT_FOUND
        assert "suspend" not in made.vms.calls
        assert made.state(P1) == "running"


async def test_two_changes_of_one_pod_run_one_after_the_other(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.vms.hold("suspend")
        answers: dict[str, Any] = {}

        async def call(name: str) -> None:
            answers[name] = await getattr(made.pods, f"{name}_pod")({"id": P1})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "suspend")
            await made.vms.waiting["suspend"].wait()
            nursery.start_soon(call, "stop")
            await trio.testing.wait_all_tasks_blocked()
            assert "delete" not in made.vms.calls  # the stop waits for the suspend's end
            made.vms.let_go("suspend")
        assert answers["suspend"]["pod"]["state"] == "suspended"
        assert answers["stop"]["pod"]["state"] == "stopped"
        tail = [c for c in made.vms.calls if c in ("suspend", "delete", "shutdown")]
        assert tail == ["suspend", "delete"]


@pytest.mark.parametrize("call", ["stop", "suspend"])
async def test_a_record_write_that_runs_out_of_time_fails_its_call(
        call: str, tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.records.hold("put")
        with pytest.raises(FeosError) as caught:
            await getattr(made.pods, f"{call}_pod")({"id": P1})
        assert caught.value.code is Code.UNAVAILABLE
        assert caught.value.message == f"pod {P1}'s record was not written within 30s"
        made.records.let_go("put")


async def test_a_record_removal_that_runs_out_of_time_keeps_the_pod(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.records.hold("remove")
        with pytest.raises(FeosError) as caught:
            await made.pods.delete_pod({"id": P1})
        assert caught.value.code is Code.UNAVAILABLE
        assert "was not written within" in caught.value.message
        assert (await made.pods.get_pod({"id": P1}))["pod"]["id"] == P1  # not answered deleted
        made.records.let_go("remove")


async def test_a_guest_that_shuts_itself_down_stops_its_pod(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        made.vms.stops_itself(P1)
        await trio.testing.wait_all_tasks_blocked()
        await made.pods._changes.wait_idle()
        assert made.state(P1) == "stopped"
        assert made.records.kept[P1]["reason"] == "its microVM stopped: the guest shut down"


@pytest.mark.parametrize(("vm", "kept", "then"), [
    (None, "running", "failed"),
    ("suspended", "running", "suspended"),
    ("running", "suspended", "running"),
    ("stopped", "running", "stopped"),
    ("running", "running", "running"),
])
async def test_a_take_over_goes_by_the_table(
        vm: str | None, kept: str, then: str, tmp_path: Path, monkeypatch: Any,
        autojump_clock: Any) -> None:
    from _podfakes import FakeVms

    from feos.pods._pod import Pod
    from feos.pods._spec import parse_spec
    from feos.vmm import VmState

    pod = Pod(P1, parse_spec(SPEC), state=kept)
    vms = FakeVms()
    if vm is not None:
        vms._set(P1, VmState(vm))
    async with node(tmp_path, monkeypatch, records=FakeRecords({P1: pod.record()}),
                    vms=vms) as made:
        assert made.state(P1) == then
        assert (await made.pods.get_pod({"id": P1}))["pod"]["state"] == then


async def test_params_are_checked_once_at_the_edge(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        with pytest.raises(FeosError, match="id: must be 11"):
            await made.pods.stop_pod({})
        with pytest.raises(FeosError, match=r"spec\.memoryMib"):
            await made.pods.create_pod({"id": P1, "spec": {"memoryMib": 3}})
        with pytest.raises(FeosError, match="command: must name a program"):
            await made.pods.exec_in_pod({"id": P1})
        with pytest.raises(FeosError, match="podId"):
            await made.pods.watch_events({"podId": "nope"})


async def test_a_create_during_the_vmm_probe_waits_for_it_and_says_so(
        tmp_path: Path, monkeypatch: Any, autojump_clock: Any) -> None:
    """feosd serves before its VMM probe ends: a pod created meanwhile shows step `vmm-probe`,
    makes no microVM until the probe has decided, then comes up."""
    async with node(tmp_path, monkeypatch) as made:
        made.vms.probe = "feosd is still probing which VMM runs pods (--vmm auto: KVM; 3 s so far)"
        made.vms.probe_done = trio.Event()
        await made.pods.create_pod({"id": P1, "spec": SPEC})
        await trio.sleep(10)
        assert made.pods._pods[P1].step == "vmm-probe"
        assert made.state(P1) == "pending"
        assert "create" not in made.vms.calls
        made.vms.probe = ""
        made.vms.probe_done.set()
        bringup = made.pods._pods[P1].bringup
        assert bringup is not None
        await bringup.done.wait()
        assert made.state(P1) == "running"
        assert "create" in made.vms.calls
