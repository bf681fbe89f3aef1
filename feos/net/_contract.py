"""What passes between the pods and their network: the values, and the pods' side as read here.

The pod service knows pods; the network knows addresses, TAP devices, the table, the resolver and
the metadata service. The network provides this contract and the pods consume it (feos.pods
imports feos.net, never the other way): the pod service calls the network's methods
(feos.pods' PodNetworkService, which `Network` implements) with these values, and the network
never calls into the pods but through the `PodsView` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs


@attrs.frozen
class PublishedPort:
    """A port of the node forwarded to the pod (spec.network.publish; docs/network.md)."""

    protocol: str  # "tcp" or "udp"
    host_address: str  # "" : every address of the node, both families
    host_port: int
    pod_port: int

    def text(self) -> str:
        """As feosctl's --publish takes it: [ADDRESS:]HOSTPORT:PODPORT/PROTOCOL."""
        host = self.host_address
        host = f"[{host}]:" if ":" in host else f"{host}:" if host else ""
        return f"{host}{self.host_port}:{self.pod_port}/{self.protocol}"


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
    published: tuple[PublishedPort, ...] = ()  # checked by the spec's parser and check_spec


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
