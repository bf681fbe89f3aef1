"""Templates that hold the pod's image (docs/templates.md, "Templates holding an image"): the
flag's and the API's syntax, the template a create picks, the make's steps (an anonymous pull on
the pods' network, a zeroing pass, then the suspend) with fakes, and the token rule: a restored
guest that holds the image pulls it with the create's own token first, which fetches no blob
for the digest it holds, fetches the new one's for a tag moved, and fails for a token the
registry refuses (the guest's store and registry client against a real registry behind a gate).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import capnp
import pytest
import trio
from test_guest_registry import (  # noqa: F401 (registry: a fixture)
    AuthProxy,
    Registry,
    push_busybox,
    push_image,
    registry,
    tar_of,
)

from feos.errors import Code, FeosError
from feos.guest._images import ImageStore
from feos.guest._token import PullToken
from feos.guest._validate import reference
from feos.net import GuestNetwork
from feos.pods._bringup import BringUp, check_held
from feos.pods._pod import Pod
from feos.pods._spec import parse_spec
from feos.pods._template_api import WarmTemplate
from feos.pods._templates import Shape, Template, TemplateKey, Templates, Warm, _netpod

GOOD = "the-creates-own-token"
IMAGE = "registry.example:5000/app/web:1"


def _key(**changes: Any) -> TemplateKey:
    fields: dict[str, Any] = dict(guest="g1", vmm="qemu", vmm_version="7.2.15", accel="tcg",
                                  shape=Shape(1, 512, 0, True), drives=1, base="sha256:" + "a" * 64)
    fields.update(changes)
    return TemplateKey(**fields)


# -- the syntax --------------------------------------------------------------------------------


def test_a_warm_names_an_image_after_an_equals_sign_and_bad_ones_are_named() -> None:
    assert Warm.parse("1x512+net") == Warm(Shape(1, 512, 0, True), "")
    assert Warm.parse(f"1x512+net={IMAGE}") == Warm(Shape(1, 512, 0, True), IMAGE)
    assert Warm.parse("2x1024+net=busybox") == Warm(Shape(2, 1024, 0, True), "busybox")
    for bad, said in ((f"1x512={IMAGE}", "needs +net"), ("1x512+net=", "is not an image"),
                      ("1x512+net=Not An Image", "is not an image"),
                      ("1x512+net=a:b:c", "is not an image"),
                      ("x512+net=busybox", "is not VCPUSxMEMORY_MIB")):
        with pytest.raises(FeosError) as e:
            Warm.parse(bad)
        assert e.value.code is Code.INVALID_ARGUMENT, bad
        assert e.value.message.startswith("shape: ") and said in e.value.message, e.value.message


def test_the_held_image_is_in_the_key_and_old_names_stay() -> None:
    plain = _key()
    assert plain.name == _key(held="").name
    assert _key(held=IMAGE).name != plain.name
    assert _key(held=IMAGE).name != _key(held=IMAGE + "0").name
    # the name of a template holding nothing is what it was before the field came
    import hashlib
    import uuid

    import attrs
    fields = attrs.asdict(plain)
    del fields["held"]
    old = uuid.UUID(bytes=hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()[:16])
    assert plain.name == str(old)
    assert WarmTemplate(network=True, image=IMAGE).image == IMAGE


# -- the template a create picks ------------------------------------------------------------


def _templates(tmp_path: Path, *keys: TemplateKey) -> Templates:
    templates = Templates(tmp_path, object(), object(), vmm_version=lambda: "7.2.15",  # type: ignore[arg-type]
                          on_first_use=False)
    for key in keys:
        templates._have[key.name] = Template(key, "sha256:" + "e" * 64, "", 1, 1)
    templates.key_for = lambda shape, base, image="", held="": _key(  # type: ignore[method-assign]
        shape=shape, base=base, image=image, held=held)

    async def whole(template: Template) -> str:
        return ""

    templates._damage = whole  # type: ignore[method-assign]
    return templates


def _pod(*images: str) -> Pod:
    return Pod("pa0000000aa", parse_spec({"containers": [
        {"name": f"c{i}", "image": image} for i, image in enumerate(images)]}))


async def _fit(templates: Templates, pod: Pod, held: str) -> Template | None:
    async with trio.open_nursery() as nursery:
        templates._nursery = nursery
        found = await templates.fitting(pod, "sha256:" + "a" * 64, "", held)
        nursery.cancel_scope.cancel()
    return found


async def test_a_create_of_the_held_image_picks_the_template_holding_it(tmp_path: Path) -> None:
    holding, plain = _key(held=IMAGE), _key()
    templates = _templates(tmp_path, holding, plain)
    found = await _fit(templates, _pod(IMAGE), IMAGE)
    assert found is not None and found.key == holding
    other = await _fit(templates, _pod("registry.example:5000/app/other:1"),
                       "registry.example:5000/app/other:1")
    assert other is not None and other.key == plain  # no template holds it: the plain one
    alone = _templates(tmp_path / "2", holding)
    assert await _fit(alone, _pod("busybox"), "busybox") is None  # boots cold
    assert await _fit(alone, _pod(IMAGE), "") is None  # two containers, or a baked disk: no held


def test_the_bring_up_asks_for_the_held_image_only_for_one_container() -> None:
    asked: list[str] = []

    class Fits:
        async def fitting(self, pod: Pod, base: str, image: str = "", held: str = "") -> None:
            asked.append(held)

    async def choose_base(*args: Any) -> str:
        return "sha256:" + "a" * 64

    bringup = BringUp.__new__(BringUp)
    bringup.templates = Fits()  # type: ignore[assignment]
    bringup._baker = type("B", (), {"diskd": None})()  # type: ignore[assignment]
    bringup._picked = {}
    trio.run(bringup._choose, _pod(IMAGE), "g1", "sha256:" + "a" * 64)
    trio.run(bringup._choose, _pod(IMAGE, "busybox"), "g1", "sha256:" + "a" * 64)
    assert asked == [IMAGE, ""]


# -- the make ---------------------------------------------------------------------------------


class _Guest:
    def __init__(self, refuse: Code | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse
        self.joined = 0  # pulls that answer "joined" before one does not

    async def configure_network(self, config: Any) -> None:
        self.calls.append(("configure_network", config.ipv6, config.ipv4))

    async def pull_image(self, reference: str, pull_token: str = "") -> tuple[str, bool]:
        self.calls.append(("pull_image", reference, pull_token))
        if self.refuse is not None:
            raise FeosError(self.refuse, f"registry refused {reference} with the pull token given")
        if self.joined:
            self.joined -= 1
            return "sha256:" + "9" * 64, True
        return "sha256:" + "9" * 64, False

    async def prepare_suspend(self, zero_free: bool = False) -> tuple[int, int]:
        self.calls.append(("prepare_suspend", zero_free))
        return 400 << 20, 420 << 20

    async def create_container(self, config: Any) -> None:
        self.calls.append(("create_container", config.image, config.pull_token))

    async def start_container(self, name: str) -> None:
        self.calls.append(("start_container", name))


class _Network:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def allocate(self, pod: Any) -> Any:
        self.calls.append("allocate")
        import attrs
        return attrs.evolve(pod, ipv6="fd00::5", ipv4="169.254.16.5")

    async def prepare(self, pod: Any) -> Any:
        self.calls.append("prepare")

    def guest_network(self, pod: Any) -> GuestNetwork:
        return GuestNetwork(ipv6=pod.ipv6 + "/128", ipv4=pod.ipv4 + "/32", resolver="fd00::53",
                            ula_only=False, mtu=1500)

    async def remove(self, pod: Any) -> None:
        self.calls.append("remove")


async def test_the_make_pulls_anonymously_zeroes_then_suspends(tmp_path: Path) -> None:
    guest, network = _Guest(), _Network()
    templates = Templates(tmp_path, object(), object(),  # type: ignore[arg-type]
                          network=lambda: network)  # type: ignore[arg-type,return-value]
    netpod = await network.allocate(_netpod("t", "qemu"))
    await templates._hold(guest, IMAGE, network, netpod)  # type: ignore[arg-type]
    assert guest.calls == [("configure_network", "fd00::5/128", "169.254.16.5/32"),
                           ("pull_image", IMAGE, ""), ("prepare_suspend", True)]
    for code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
        with pytest.raises(FeosError) as e:
            await templates._hold(_Guest(refuse=code), IMAGE, network, netpod)  # type: ignore[arg-type]
        assert e.value.code is Code.FAILED_PRECONDITION
        assert f"image {IMAGE} needs a pull token" in e.value.message


async def test_a_template_holding_an_image_needs_a_network(tmp_path: Path) -> None:
    templates = Templates(tmp_path, object(), object())  # type: ignore[arg-type]
    with pytest.raises(FeosError) as e:
        await templates.warm(Shape(1, 512, 0, False), "sha256:" + "a" * 64, IMAGE)
    assert e.value.code is Code.INVALID_ARGUMENT and e.value.message.startswith("image: ")
    with pytest.raises(FeosError) as e:
        await templates._make(_key(held=IMAGE))
    assert e.value.code is Code.FAILED_PRECONDITION and "no pods' network" in e.value.message


# -- the token rule: the host's side ----------------------------------------------------------


async def test_a_restored_pod_pulls_with_its_own_token_before_its_container() -> None:
    pod = _pod(IMAGE)
    pod.came_up = "template:x"
    guest = _Guest()
    await BringUp._start_containers(None, pod, guest, GOOD, fresh=True)  # type: ignore[arg-type]
    assert guest.calls == [("pull_image", IMAGE, GOOD), ("create_container", IMAGE, GOOD),
                           ("start_container", "c0")]
    refused = _Guest(refuse=Code.UNAUTHENTICATED)
    with pytest.raises(FeosError) as e:
        await BringUp._start_containers(None, pod, refused, "not-good", fresh=True)  # type: ignore[arg-type]
    assert e.value.code is Code.UNAUTHENTICATED and e.value.message.startswith("container c0: ")
    assert [c[0] for c in refused.calls] == ["pull_image"]  # no container of the held image
    cold = _pod(IMAGE)
    cold.came_up = "cold"
    plain = _Guest()
    await BringUp._start_containers(None, cold, plain, GOOD, fresh=True)  # type: ignore[arg-type]
    assert [c[0] for c in plain.calls] == ["create_container", "start_container"]


async def test_a_pull_that_joined_anothers_is_asked_again() -> None:
    guest = _Guest()
    guest.joined = 1
    await check_held(guest, IMAGE, GOOD)  # type: ignore[arg-type]
    assert guest.calls == [("pull_image", IMAGE, GOOD)] * 2
    guest.joined = 5
    with pytest.raises(FeosError) as e:
        await check_held(guest, IMAGE, GOOD)  # type: ignore[arg-type]
    assert e.value.code is Code.UNAVAILABLE


# -- the token rule: the guest's store against a registry --------------------------------------


def _pull(store: ImageStore, text: str, token: str) -> Any:
    return asyncio.run(capnp.run(store.pull(text, PullToken(token) if token else None)))[0]


def test_the_held_digest_is_checked_with_the_creates_token(
    registry: Registry, tmp_path: Path  # noqa: F811
) -> None:
    gate = AuthProxy(registry.host, GOOD, anonymous=True)  # a public repository's registry
    try:
        push_busybox(registry.host, "feos/held", "1")
        text = f"{gate.host}/feos/held:1"
        store = ImageStore(str(tmp_path))
        held = _pull(store, text, "")  # the template's anonymous pull
        assert gate.blobs() and all(not token for _, token in gate.seen)
        gate.seen.clear()
        again = _pull(store, text, GOOD)  # a restored pod's, with its own token
        assert again.digest == held.digest
        assert gate.blobs() == [] and [bool(t) for _, t in gate.seen] == [True]  # manifest only
        with pytest.raises(FeosError) as e:
            _pull(store, text, "a-token-the-registry-refuses")
        assert e.value.code is Code.UNAUTHENTICATED and "refused" in e.value.message
        # the tag moved: the pod's pull fetches the new image's blobs, as a cold create's does
        push_image(registry.host, "feos/held", "1", [tar_of({"moved": "yes"})],
                   {"Cmd": ["/bin/sh"]})
        gate.seen.clear()
        moved = _pull(store, text, GOOD)
        assert moved.digest != held.digest and gate.blobs()
        assert store.find(reference("r", text)) is not None
    finally:
        gate.close()


# -- the guest's zeroing pass -----------------------------------------------------------------


def test_the_zeroing_pass_stops_at_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    from feos.guest import _system

    free = [_system.ZERO_MARGIN + 3 * _system.ZERO_CHUNK + 4096]
    asked = []

    def mem_free() -> int:  # each chunk faulted in takes its size off the free memory
        asked.append(free[0])
        return free[0] - (len(asked) - 1) * _system.ZERO_CHUNK

    monkeypatch.setattr(_system, "mem_free", mem_free)
    assert _system.zero_free_memory() == 3 * _system.ZERO_CHUNK
    assert len(asked) == 4  # three chunks, then the margin reached
