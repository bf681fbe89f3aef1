"""What the pod service asks of the pods' network (implemented by feos.net's Network service).

The values that pass (PodNet, Link, GuestNetwork) and the pods' side as the network reads it
(PodsView) are the network's: feos.net offers them. The pod service calls these methods at the
points their docstrings name.
"""

from __future__ import annotations

from typing import Protocol

from feos.net import GuestNetwork, Link, PodNet, PodsView


class PodNetworkService(Protocol):
    def unavailable(self) -> str | None:
        """Why pods with a network cannot be made now ("no --pod-prefix ..."), or None."""
        ...

    def check_spec(self, pod: PodNet) -> None:
        """At create: INVALID_ARGUMENT naming the field for a bad upstream or metadata;
        FAILED_PRECONDITION with the reason while unavailable()."""
        ...

    async def allocate(self, pod: PodNet) -> PodNet:
        """The pod with an IPv6 and an IPv4 address; the counter and pool files are written
        before the addresses are handed out. Kept addresses are kept (idempotent)."""
        ...

    async def prepare(self, pod: PodNet) -> Link:
        """Before every boot and resume: FAILED_PRECONDITION naming the groups or tables the node
        lacks; else the TAP made as the spec lists, the pod in the table, the resolver and the
        metadata service knowing it."""
        ...

    def guest_network(self, pod: PodNet) -> GuestNetwork: ...

    async def remove(self, pod: PodNet) -> None:
        """At deletion: off the network (resolver, TAP), its conntrack entries deleted, out of the
        table, its IPv4 address freed. Idempotent."""
        ...

    def pods_changed(self) -> None:
        """The pods or what they name changed: the table is brought up to date soon."""
        ...


__all__ = ["GuestNetwork", "Link", "PodNet", "PodNetworkService", "PodsView"]
