"""Baked images (ADR 0025): the layer a pod's new disk starts on, and the bake at the bake point.

A create may name image_layers (the image of the pod's one container, layers baked of it,
mayBake), kept in the pod's record and never compared with the spec. The record's `disk` says
what the disk was made on: "layer:<digest>" for a baked layer, "blank:<guest version>" for that
guest's blank data volume (its L0 in diskd).

- The disk's base (`choose_base`, once, when the bring-up makes the disk): the first layer named
  that diskd has or fetches (Pull) and that is made for the newest guest installed. One that
  cannot be fetched, or is made for another guest, is passed over with a line in the log; with
  none the disk is on the blank data volume.
- The bake point (`Baker.bake_point`, after the volumes are mounted, before the first container):
  a pod on the blank data volume whose create says mayBake, whose disk was not baked yet, whose
  guest does not have the image's container yet, on a diskd with an object store, has its guest
  pull the image (PullImage, with the pull token), /data frozen (a thaw first: a restart may have
  cut off a freeze), the disk's top sealed as a layer on L0 (diskd's Bake), /data thawed. A pull,
  freeze or seal that fails leaves the bring-up going on as without a bake; a thaw that fails
  fails the bring-up (its data volume would stay frozen).
- The push (in the Baker's nursery, outside the pod's lock: an upload takes long): diskd's Push,
  which tries three times itself. Once it is there, `pushed` (the pod service's) records the
  layer in the pod's `baked` and tells the pod's watchers. A push that fails, or that a restart
  of feosd cut off, is logged and not tried again: the layer stays on the node (a collect
  removes it, no disk stands on it). A bring-up cut off between the seal and its container
  bakes again (diskd seals a copy of the top: the disk itself stays as it was).

A pod whose disk was made on a baked layer hands no pull token to its guest (`token_for`).

diskd is reached through its client's one method (the Protocol below, feos.disk.Diskd's), the
guest through feos.pods._ports.Guest.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from ..errors import Code, FeosError
from ._pod import Pod
from ._ports import Guest

log = logging.getLogger(__name__)

BLANK, LAYER = "blank:", "layer:"
THAW_S = 10.0  # a thaw of /data that does not end within it leaves the bring-up failed


class Diskd(Protocol):
    """diskd's client (feos.disk.Diskd): one call of schema/disk.capnp's DiskService, its results
    as a dict (camelCase), FeosError for a status that is not ok."""

    async def call(self, method: str, *, wait: bool = True, **params: Any) -> dict[str, Any]: ...


def on_layer(pod: Pod) -> bool:
    """Whether the pod's disk was made on a baked layer."""
    return pod.disk.startswith(LAYER)


def token_for(pod: Pod, token: str) -> str:
    """The pull token the bring-up hands the guest: none for a disk made on a baked layer."""
    return "" if on_layer(pod) else token


def named_layers(pod: Pod) -> list[str]:
    layers = pod.image_layers.get("layers") or []
    return [str(digest) for digest in layers]


async def choose_base(diskd: Diskd | None, pod: Pod, guest: str, blank: str) -> str:
    """The digest the pod's new disk is made on (`blank`, the guest's L0, when no layer named
    will do), with pod.disk set to say so."""
    for digest in named_layers(pod) if diskd is not None else []:
        assert diskd is not None
        try:
            layer = (await diskd.call("pull", digest=digest)).get("layer", {})
        except FeosError as exc:
            log.warning("pod %s: layer %s passed over: %s", pod.id, digest, exc.message)
            continue
        made_for = layer.get("guest", "")
        if made_for != guest:
            log.info("pod %s: layer %s passed over: made for guest %s, not %s", pod.id,
                     digest, made_for or "(none)", guest)
            continue
        pod.disk = LAYER + layer.get("digest", digest)
        return pod.disk.removeprefix(LAYER)
    pod.disk = BLANK + guest
    return blank


class Baker:
    """The bake point of the pods' bring-ups, and the pushes of what they baked."""

    def __init__(self, diskd: Diskd | None,
                 pushed: Callable[[Pod, str], Awaitable[None]]) -> None:
        self.diskd = diskd
        self._pushed = pushed
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[Baker] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    async def bake_point(self, pod: Pod, guest: Guest, token: str) -> None:
        """Bake the pod's image into a layer if the pod may and should; FeosError only for a
        data volume that stays frozen."""
        image = str(pod.image_layers.get("image") or "")
        if self.diskd is None or not self._may(pod, image):
            return
        why = await self._not_now(pod, guest, image)
        if why:
            log.info("pod %s: not baked: %s", pod.id, why)
            return
        digest = await self._bake(pod, guest, image, token)
        if digest:
            self._push(pod, digest)

    def _may(self, pod: Pod, image: str) -> bool:
        return bool(pod.image_layers.get("mayBake")) and bool(image) and not on_layer(pod) \
            and not pod.baked

    async def _not_now(self, pod: Pod, guest: Guest, image: str) -> str:
        """Why the pod does not bake now; "" when it does."""
        assert self.diskd is not None
        names = {c.name for c in pod.spec.containers if c.image == image}
        if not names:
            return f"no container of the spec runs {image}"
        try:
            store = (await self.diskd.call("info"))["info"].get("store", {})
            if not store.get("configured"):
                return f"diskd has no object store ({store.get('reason') or 'not configured'})"
            have = {c.name for c in await guest.list_containers()}
        except FeosError as exc:
            return exc.message
        if names & have:
            return "the guest has its container already"
        return ""

    async def _bake(self, pod: Pod, guest: Guest, image: str, token: str) -> str:
        """The bake's steps; the layer's digest, or "" when a pull, freeze or seal failed."""
        assert self.diskd is not None
        try:
            await guest.pull_image(image, token)
        except FeosError as exc:
            log.warning("pod %s: not baked: the pull of %s failed: %s", pod.id, image,
                        exc.message)
            return ""
        try:
            await guest.thaw_filesystem()  # a freeze that a restart of feosd cut off
            await guest.freeze_filesystem()
        except FeosError as exc:
            log.warning("pod %s: not baked: /data did not freeze: %s", pod.id, exc.message)
            await _thaw(pod, guest)
            return ""
        try:
            digest: str = (await self.diskd.call("bake", id=pod.id, image=image))["layer"]["digest"]
        except FeosError as exc:
            log.warning("pod %s: not baked: diskd did not seal its disk: %s", pod.id,
                        exc.message)
            return ""
        finally:
            await _thaw(pod, guest)
        log.info("pod %s: %s baked into layer %s", pod.id, image, digest)
        return digest

    def _push(self, pod: Pod, digest: str) -> None:
        assert self._nursery is not None, "the baker does not run"
        self._nursery.start_soon(self._push_now, pod, digest)

    async def _push_now(self, pod: Pod, digest: str) -> None:
        assert self.diskd is not None
        try:
            await self.diskd.call("push", digest=digest)
        except FeosError as exc:
            log.warning("pod %s: the baked layer %s was not pushed: %s", pod.id, digest,
                        exc.message)
            return
        await self._pushed(pod, digest)


async def _thaw(pod: Pod, guest: Guest) -> None:
    """/data thawed, whatever cancelled the bake: a frozen one would hang the pod's writes."""
    with trio.move_on_after(THAW_S, shield=True) as scope:
        try:
            await guest.thaw_filesystem()
        except FeosError as exc:
            if exc.code is Code.UNIMPLEMENTED:  # a guest that cannot freeze froze nothing
                return
            raise FeosError(Code.INTERNAL, f"the data volume stays frozen: {exc.message}") \
                from None
    if scope.cancelled_caught:
        raise FeosError(Code.DEADLINE_EXCEEDED,
                        f"the data volume stays frozen: no thaw within {THAW_S:g}s")
