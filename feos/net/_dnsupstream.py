"""The checks a pod's DNS upstreams pass at create (PodNetwork.dns_upstreams), and the defaults.

An upstream is an IP address that the node asks on the pod's behalf, on port 53: it must be
somewhere outside the node and outside the pods, or a pod could make the node query itself, its
own services or another pod.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Sequence

from feos.errors import invalid

from ._nametable import Address

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_UPSTREAMS: tuple[Address, ...] = tuple(
    ipaddress.ip_address(a)
    for a in ("2001:4860:4860::8888", "2606:4700:4700::1111", "8.8.8.8", "1.1.1.1")
)
MAX_UPSTREAMS = 8


def validate_upstreams(
    upstreams: Sequence[str],
    *,
    resolver: ipaddress.IPv4Address,
    denied: Collection[Network] = (),
    pod_prefix: ipaddress.IPv6Network | None = None,
    pod_ipv4_range: ipaddress.IPv4Network | None = None,
    node_addresses: Collection[Address] = (),
) -> tuple[Address, ...]:
    """The upstreams as addresses, in order; invalid("spec.network.dns_upstreams[i]", why)."""
    if len(upstreams) > MAX_UPSTREAMS:
        raise invalid("spec.network.dns_upstreams", f"at most {MAX_UPSTREAMS} upstreams")
    out: list[Address] = []
    for i, text in enumerate(upstreams):
        field = f"spec.network.dns_upstreams[{i}]"
        why = _refusal(text, resolver, denied, pod_prefix, pod_ipv4_range, node_addresses)
        if why is not None:
            raise invalid(field, why)
        address = ipaddress.ip_address(text)
        if address in out:
            raise invalid(field, f"{address} is named twice")
        out.append(address)
    return tuple(out)


def _refusal(
    text: str,
    resolver: ipaddress.IPv4Address,
    denied: Collection[Network],
    pod_prefix: ipaddress.IPv6Network | None,
    pod_ipv4_range: ipaddress.IPv4Network | None,
    node_addresses: Collection[Address],
) -> str | None:
    """Why the upstream is refused, or None."""
    try:
        address = ipaddress.ip_address(text) if isinstance(text, str) else None
    except ValueError:
        address = None
    if address is None:
        return f"{text!r} is not an IP address"
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        return "must not have a zone"
    # An IPv4-mapped IPv6 address reaches the IPv4 address it maps: judge that one too.
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    for candidate in (address, mapped):
        if candidate is None:
            continue
        why = _kind(candidate, resolver)
        if why is None and any(
            candidate in net for net in denied if net.version == candidate.version
        ):
            why = "is in a denied prefix"
        if why is None and (
            (pod_prefix is not None and candidate in pod_prefix)
            or (pod_ipv4_range is not None and candidate in pod_ipv4_range)
        ):
            why = "is a pod's address (the pod prefix or the pods' IPv4 range)"
        if why is None and candidate in node_addresses:
            why = "is one of the node's addresses"
        if why is not None:
            return f"{address} {why}"
    return None


def _kind(address: Address, resolver: ipaddress.IPv4Address) -> str | None:
    if address == resolver:
        return "is the resolver itself"
    if address.is_unspecified:
        return "is the unspecified address"
    if address.is_loopback:
        return "is a loopback address"
    if address.is_link_local:
        return "is a link-local address"
    if address.is_multicast:
        return "is a multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address == ipaddress.IPv4Address(
        "255.255.255.255"
    ):
        return "is the broadcast address"
    return None
