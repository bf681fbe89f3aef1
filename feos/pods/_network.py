"""What the pod service asks of the pods' network (implemented by feos.net's Network service).

The pod service knows pods; the network knows addresses, TAP devices, the table, the resolver and
the metadata service. This is the whole of what passes between them: the pod service calls these
methods at the points its docstrings name, and the network never calls into the pods but through
the `PodsView` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs


@attrs.frozen
class PodNet:
    """A pod as the network sees it."""

    id: str
    ipv6: str  # "" until allocated
    ipv4: str
    security_groups: tuple[str, ...]  # () : the default group
    name_tables: tuple[str, ...]
    dns_upstreams: tuple[str, ...]  # () : feosd's --dns-upstream
    metadata_json: str  # the spec's metadata object, as JSON
    driver: str  # "qemu" (the node serves metadata on the TAP) or "firecracker" (MMDS)
    tap_owner_uid: int | None = None  # the microVM's own user, who owns its TAP


@attrs.frozen
class Link:
    """The pod's link, made before a boot or resume."""

    tap: str
    mac: str


@attrs.frozen
class GuestNetwork:
    """What the guest is pushed (GuestService.configureNetwork)."""

    ipv6: str  # a /128 via fe80::1
    ipv4: str  # a /32 via 169.254.0.1, on the link
    resolver: str  # the resolver's address
    ula_only: bool  # route fc00::/7 via fe80::1 instead of a default route
    mtu: int


class PodsView(Protocol):
    """The pod service's side, as the network reads it."""

    def network_pods(self) -> Sequence[PodNet]:
        """Every pod with a network kept on the node, with the addresses it holds."""
        ...


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

    def guest_network(self, pod: PodNet) -> GuestNetwork:
        ...

    async def remove(self, pod: PodNet) -> None:
        """At deletion: off the network (resolver, TAP), its conntrack entries deleted, out of the
        table, its IPv4 address freed. Idempotent."""
        ...

    def pods_changed(self) -> None:
        """The pods or what they name changed: the table is brought up to date soon."""
        ...


__all__ = ["GuestNetwork", "Link", "PodNet", "PodNetworkService", "PodsView", "Sequence"]
