"""A pod as the pod service holds it, and its record (<state-dir>/pods/<id>.pb) both ways.

A `Pod` is mutable and one per pod the node keeps: a pod deleted and created again with the same
ID is another `Pod`, which is how a change that waited tells that its pod is gone. Its lock
serialises the changes; `bringup` is the bring-up's own inner scope, which a stop or a delete
ends to end it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import _lifecycle as lc
from ._spec import PodSpec, check_pod_id, parse_spec

if TYPE_CHECKING:
    from ._changes import Change


@attrs.define(eq=False)
class Pod:
    id: str
    spec: PodSpec
    state: str = lc.PENDING
    reason: str = ""
    step: str = ""
    ipv6: str = ""
    ipv4: str = ""
    created_ns: int = 0
    changed_ns: int = 0
    guest_version: str = ""
    driver: str = ""  # the VMM it booted with, as the microVM layer names it; kept across restarts
    image_layers: dict[str, Any] = attrs.field(factory=dict)
    disk: str = ""  # what its disk was made on (feos.pods._bake: "blank:<guest>", "layer:<digest>")
    baked: str = ""  # the layer baked of it, once it is in the object store
    generation: int = 0
    checkpoint: str = ""  # while HIBERNATED: its checkpoint's reference in the object store
    came_up: str = ""  # its last bring-up's way: "cold", or "template:<name>" (a restore)
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    bringup: Change[None] | None = None  # the bring-up in flight, or the last one
    pull_token: str = attrs.field(default="", repr=False)  # memory only, for the next bring-up
    hibernation: Any = None  # the hibernation in flight (feos.pods._hibernate.Progress)
    hibernating: Change[dict[str, Any]] | None = None  # its change, which a second call joins

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id, "spec": self.spec.to_dict(), "state": self.state,
            "reason": self.reason, "step": self.step, "ipv6Address": self.ipv6,
            "ipv4Address": self.ipv4, "createdUnixNs": self.created_ns,
            "changedUnixNs": self.changed_ns, "guestVersion": self.guest_version,
            "driver": self.driver, "imageLayers": self.image_layers,
            "disk": self.disk, "baked": self.baked, "generation": self.generation,
            "checkpoint": self.checkpoint,
            "cameUp": self.came_up,
        }  # fmt: skip

    def answer(self, containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The pod as the API answers it (PodInfo), with its containers' states while it runs."""
        answer = self.record()
        if containers:
            answer["containers"] = containers
        if self.hibernation is not None:
            answer["hibernation"] = self.hibernation.answer()
        return answer


def from_record(data: dict[str, Any]) -> Pod:
    """A kept pod; INVALID_ARGUMENT for a record whose ID or spec would be refused at create."""
    return Pod(
        id=check_pod_id(data.get("id", "")), spec=parse_spec(data.get("spec", {})),
        state=data.get("state", lc.PENDING), reason=data.get("reason", ""),
        step=data.get("step", ""), ipv6=data.get("ipv6Address", ""),
        ipv4=data.get("ipv4Address", ""), created_ns=data.get("createdUnixNs", 0),
        changed_ns=data.get("changedUnixNs", 0), guest_version=data.get("guestVersion", ""),
        driver=data.get("driver", ""), image_layers=data.get("imageLayers", {}),
        disk=data.get("disk", ""), baked=data.get("baked", ""),
        generation=data.get("generation", 0), checkpoint=data.get("checkpoint", ""),
        came_up=data.get("cameUp", ""),
    )  # fmt: skip


CONTAINER_STATES = {"created": "created", "running": "running", "stopped": "exited"}


def container_status(state: Any) -> dict[str, Any]:
    """A guest's ContainerState as the API's ContainerStatus."""
    return {"name": state.name, "state": CONTAINER_STATES.get(state.status, "unknown"),
            "exitCode": state.exit_code, "pid": state.pid, "startedUnixNs": state.started_ns,
            "finishedUnixNs": state.finished_ns}
