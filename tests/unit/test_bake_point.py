"""Baked images (feos.pods._bake) over fakes of diskd's client and of the guest, the unit's edge.

The base of a new disk (the first layer for the newest guest that diskd has or fetches, else the
blank data volume), each way the bake point does not bake, the bake's steps in order, each of its
failures (the bring-up goes on, but for a volume that stays frozen), the push in the background
and what it tells, the pull token a pod on a baked layer does not hand on, feosctl's --layer and --bake, and the
pod service's record and event once a layer is in the object store.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _podfakes import P1, node, running_pod

from feos.cli._commands import UsageError
from feos.cli._pods import image_layers
from feos.errors import Code, FeosError
from feos.pods._bake import BLANK, LAYER, Baker, choose_base, token_for
from feos.pods._pod import Pod
from feos.pods._spec import parse_spec

GUEST, OLD = "g2", "g1"
L0 = "sha256:" + "0" * 64
A, B, C = ("sha256:" + x * 64 for x in "abc")
NEW = "sha256:" + "d" * 64
IMAGE = "registry.test/feos/demo:1"


@attrs.frozen
class Container:
    name: str


class FakeDiskd:
    """diskd's client: layers it has or the store holds (digest -> guest), failures by method."""

    def __init__(self, layers: dict[str, str] | None = None, *, store: bool = True) -> None:
        self.layers = dict(layers or {})
        self.store = store
        self.fail: dict[str, FeosError] = {}
        self.calls: list[tuple[str, str]] = []
        self.push_held: trio.Event | None = None

    def _call(self, name: str, arg: str) -> None:
        self.calls.append((name, arg))
        if name in self.fail:
            raise self.fail[name]

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]:
        arg = str(params.get("digest") or params.get("id") or "")
        if method != "info":
            self._call(method, arg)
        return await getattr(self, method)(arg)

    async def info(self, _: str) -> dict[str, Any]:
        store = {"configured": True} if self.store else {"reason": "no bucket (--s3-bucket)"}
        return {"info": {"store": store}}

    async def pull(self, digest: str) -> dict[str, Any]:
        if digest not in self.layers:
            raise FeosError(Code.NOT_FOUND, f"the object store has no layer {digest}")
        return {"layer": {"digest": digest, "guest": self.layers[digest]}}

    async def bake(self, disk_id: str) -> dict[str, Any]:
        return {"layer": {"digest": NEW, "guest": GUEST}}

    async def push(self, digest: str) -> dict[str, Any]:
        if self.push_held is not None:
            await self.push_held.wait()
        return {"layer": {"digest": digest, "pushed": True}}


class FakeGuest:
    def __init__(self, containers: tuple[str, ...] = ()) -> None:
        self.containers = containers
        self.calls: list[str] = []
        self.fail: dict[str, FeosError] = {}
        self.frozen = False

    def _call(self, name: str, said: str = "") -> None:
        self.calls.append(said or name)
        if name in self.fail:
            raise self.fail[name]

    async def list_containers(self) -> list[Container]:
        self._call("list_containers")
        return [Container(name) for name in self.containers]

    async def assume(self, identity: object) -> None:
        pass  # the identity's own tests: test_templates_unit

    async def pull_image(self, reference: str, pull_token: str = "") -> tuple[str, bool]:
        self._call("pull_image", f"pull_image {reference} token={pull_token}")
        return "sha256:" + "e" * 64, False

    async def freeze_filesystem(self) -> None:
        self._call("freeze")
        self.frozen = True

    async def thaw_filesystem(self) -> None:
        self._call("thaw")
        self.frozen = False


def _pod(layers: tuple[str, ...] = (), *, may_bake: bool = True, disk: str = BLANK + GUEST,
         image: str = IMAGE) -> Pod:
    spec = parse_spec({"network": {"none": None}, "memoryMib": 256,
                       "containers": [{"name": "main", "image": IMAGE}]})
    return Pod("pa0000000aa", spec, disk=disk,
               image_layers={"image": image, "layers": list(layers), "mayBake": may_bake})


# -- the disk's base -----------------------------------------------------------------------------


async def test_base_is_the_first_layer_for_the_newest_guest() -> None:
    diskd = FakeDiskd({A: OLD, B: GUEST, C: GUEST})
    pod = _pod((A, B, C))
    assert await choose_base(diskd, pod, GUEST, L0) == B
    assert pod.disk == LAYER + B
    assert diskd.calls == [("pull", A), ("pull", B)]  # C not asked for


async def test_a_layer_that_cannot_be_fetched_is_passed_over(caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    diskd = FakeDiskd({B: GUEST})
    pod = _pod((A, B))
    assert await choose_base(diskd, pod, GUEST, L0) == B
    assert f"layer {A} passed over: the object store has no layer" in caplog.text


async def test_with_no_layer_that_will_do_the_disk_is_blank() -> None:
    diskd = FakeDiskd({A: OLD})
    pod = _pod((A, B))
    assert await choose_base(diskd, pod, GUEST, L0) == L0
    assert pod.disk == f"blank:{GUEST}"


async def test_without_diskd_or_layers_the_disk_is_blank() -> None:
    pod = _pod((A,))
    assert await choose_base(None, pod, GUEST, L0) == L0
    assert pod.disk == BLANK + GUEST
    diskd = FakeDiskd({A: GUEST})
    assert await choose_base(diskd, _pod(), GUEST, L0) == L0
    assert diskd.calls == []


def test_a_pod_on_a_baked_layer_hands_no_pull_token() -> None:
    assert token_for(_pod(disk=LAYER + A), "secret") == ""
    assert token_for(_pod(), "secret") == "secret"


# -- the bake point --------------------------------------------------------------------------------


class Baking:
    def __init__(self, baker: Baker, pushed: list[tuple[str, str]]) -> None:
        self.baker, self.pushed = baker, pushed


async def _baker(nursery: trio.Nursery, diskd: FakeDiskd | None) -> Baking:
    pushed: list[tuple[str, str]] = []

    async def record(pod: Pod, digest: str) -> None:
        pushed.append((pod.id, digest))

    baker = await nursery.start(Baker(diskd, record).run)
    return Baking(baker, pushed)


async def test_the_bake_in_order_then_the_push(nursery: trio.Nursery) -> None:
    diskd, guest, pod = FakeDiskd(), FakeGuest(), _pod()
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(pod, guest, "secret")
    assert guest.calls == ["list_containers", f"pull_image {IMAGE} token=secret", "thaw",
                           "freeze", "thaw"]
    assert not guest.frozen
    await trio.testing.wait_all_tasks_blocked()
    assert [name for name, _ in diskd.calls] == ["bake", "push"]
    assert made.pushed == [(pod.id, NEW)]


async def test_the_push_runs_behind_the_bring_up(nursery: trio.Nursery) -> None:
    diskd, pod = FakeDiskd(), _pod()
    diskd.push_held = trio.Event()
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(pod, FakeGuest(), "")  # returns while the push waits
    await trio.testing.wait_all_tasks_blocked()
    assert ("push", NEW) in diskd.calls and made.pushed == []
    diskd.push_held.set()
    await trio.testing.wait_all_tasks_blocked()
    assert made.pushed == [(pod.id, NEW)]


async def test_a_push_that_fails_tells_nothing(nursery: trio.Nursery,
                                               caplog: pytest.LogCaptureFixture) -> None:
    diskd = FakeDiskd()
    diskd.fail["push"] = FeosError(Code.UNAVAILABLE, "the bucket refused: AccessDenied")
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(_pod(), FakeGuest(), "")
    await trio.testing.wait_all_tasks_blocked()
    assert made.pushed == []
    assert "was not pushed: the bucket refused: AccessDenied" in caplog.text


def _no_bake(guest: FakeGuest, diskd: FakeDiskd) -> None:
    assert not any(c.startswith(("pull_image", "freeze")) for c in guest.calls)
    assert all(name not in ("bake", "push") for name, _ in diskd.calls)


@pytest.mark.parametrize(("why", "pod", "diskd", "guest"), [
    ("not allowed", _pod(may_bake=False), FakeDiskd(), FakeGuest()),
    ("on a baked layer", _pod(disk=LAYER + A), FakeDiskd(), FakeGuest()),
    ("no image", _pod(image=""), FakeDiskd(), FakeGuest()),
    ("an image no container runs", _pod(image="registry.test/other:1"), FakeDiskd(), FakeGuest()),
    ("the guest has the container", _pod(), FakeDiskd(), FakeGuest(("main",))),
    ("no object store", _pod(), FakeDiskd(store=False), FakeGuest()),
])
async def test_when_it_does_not_bake(nursery: trio.Nursery, why: str, pod: Pod,
                                     diskd: FakeDiskd, guest: FakeGuest) -> None:
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(pod, guest, "")
    await trio.testing.wait_all_tasks_blocked()
    _no_bake(guest, diskd)
    assert made.pushed == []


async def test_without_diskd_nothing_is_asked(nursery: trio.Nursery) -> None:
    guest = FakeGuest()
    made = await _baker(nursery, None)
    await made.baker.bake_point(_pod(), guest, "")
    assert guest.calls == []


async def test_a_pod_whose_layer_is_pushed_bakes_no_more(nursery: trio.Nursery) -> None:
    diskd, guest, pod = FakeDiskd(), FakeGuest(), _pod()
    pod.baked = NEW
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(pod, guest, "")
    _no_bake(guest, diskd)


@pytest.mark.parametrize(("fails", "calls"), [
    ("pull_image", [f"pull_image {IMAGE} token="]),
    ("freeze", [f"pull_image {IMAGE} token=", "thaw", "freeze", "thaw"]),
    ("bake", [f"pull_image {IMAGE} token=", "thaw", "freeze", "thaw"]),
])
async def test_a_failed_step_leaves_the_bring_up_going(nursery: trio.Nursery, fails: str,
                                                       calls: list[str]) -> None:
    diskd, guest = FakeDiskd(), FakeGuest()
    error = FeosError(Code.INTERNAL, f"{fails} failed")
    (diskd.fail if fails == "bake" else guest.fail)[fails] = error
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(_pod(), guest, "")  # no error
    await trio.testing.wait_all_tasks_blocked()
    assert guest.calls[1:] == calls
    if fails == "freeze":  # the pull went through before
        assert ("bake", "pa0000000aa") not in diskd.calls
    assert not guest.frozen
    assert made.pushed == [] and ("push", NEW) not in diskd.calls


async def test_a_volume_that_stays_frozen_fails_the_bring_up(nursery: trio.Nursery) -> None:
    diskd, guest = FakeDiskd(), FakeGuest()
    made = await _baker(nursery, diskd)
    thaws = 0

    async def thaw() -> None:
        nonlocal thaws
        thaws += 1
        if thaws > 1:  # the first, before the freeze, finds nothing frozen
            raise FeosError(Code.INTERNAL, "FITHAW of /data: Input/output error")

    guest.thaw_filesystem = thaw  # type: ignore[method-assign]
    with pytest.raises(FeosError, match="the data volume stays frozen: FITHAW") as caught:
        await made.baker.bake_point(_pod(), guest, "")
    assert caught.value.code is Code.INTERNAL


async def test_a_thaw_that_hangs_fails_the_bring_up(nursery: trio.Nursery,
                                                    autojump_clock: trio.abc.Clock) -> None:
    diskd, guest = FakeDiskd(), FakeGuest()
    made = await _baker(nursery, diskd)
    diskd.fail["bake"] = FeosError(Code.INTERNAL, "no space")
    thaws = 0

    async def thaw() -> None:
        nonlocal thaws
        thaws += 1
        if thaws > 1:
            await trio.sleep_forever()

    guest.thaw_filesystem = thaw  # type: ignore[method-assign]
    with pytest.raises(FeosError, match="no thaw within 10s") as caught:
        await made.baker.bake_point(_pod(), guest, "")
    assert caught.value.code is Code.DEADLINE_EXCEEDED


async def test_a_guest_that_cannot_freeze_goes_on(nursery: trio.Nursery) -> None:
    diskd, guest = FakeDiskd(), FakeGuest()
    guest.fail["thaw"] = FeosError(Code.UNIMPLEMENTED, "no thawFilesystem")
    made = await _baker(nursery, diskd)
    await made.baker.bake_point(_pod(), guest, "")
    assert ("bake", "pa0000000aa") not in diskd.calls




# -- feosctl pod create --layer --bake -------------------------------------------------------------


def test_feosctl_names_the_layers_of_the_one_container() -> None:
    spec = {"containers": [{"name": "main", "image": IMAGE}]}
    args = argparse.Namespace(layer=[A, B], bake=True)
    assert image_layers(args, spec) == {
        "imageLayers": {"image": IMAGE, "layers": [A, B], "mayBake": True}}
    assert image_layers(argparse.Namespace(layer=[], bake=False), spec) == {}


def test_feosctl_refuses_layers_for_two_containers() -> None:
    spec = {"containers": [{"name": "a", "image": IMAGE}, {"name": "b", "image": IMAGE}]}
    with pytest.raises(UsageError, match="need a pod of one container"):
        image_layers(argparse.Namespace(layer=[], bake=True), spec)


# -- the pod service: a pushed layer in the record and the pod's event ---------------------------


async def test_a_pushed_layer_is_recorded_and_told(tmp_path: Path, monkeypatch: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        watcher = made.pods.events.watch(P1)
        pod = made.pods._pods[P1]
        await made.pods._baked(pod, NEW)  # as the baker calls it once the push went through
        await trio.testing.wait_all_tasks_blocked()  # the change ran
        assert made.records.kept[P1]["baked"] == NEW
        assert made.pods._pods[P1].baked == NEW
        events = (await watcher.next({"max": 16}))["events"]
        assert any(e["reason"] == f"baked {NEW} is in the object store" for e in events)


async def test_a_pushed_layer_of_a_deleted_pod_writes_no_record(tmp_path: Path,
                                                                monkeypatch: Any) -> None:
    async with node(tmp_path, monkeypatch) as made:
        await running_pod(made)
        pod = made.pods._pods[P1]
        await made.pods.delete_pod({"id": P1})
        await made.pods._baked(pod, NEW)
        await trio.testing.wait_all_tasks_blocked()
        assert P1 not in made.records.kept
