"""The pure parts of the pods' network service: which pods the network knows, and what the
table's compiler, the resolver and the guest are given (feos.net._service does the I/O).

The netlink readers at the end are sync functions of an IPRoute, run by `_links.in_thread`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
from pyroute2 import IPRoute  # type: ignore[import-untyped]

from feos.errors import FeosError

from . import _nft as nft
from ._contract import GuestNetwork, PodNet
from ._dnsmsg import type_name  # the one table of type mnemonics
from ._dnsresolver import PodDns, QueryRecord
from ._groups import SecurityGroup
from ._links import tap_name
from ._mmds import metadata_object
from ._options import Addr, NetworkOptions
from ._traffic import DnsQuery

ULA = ipaddress.IPv6Network("fc00::/7")
MESH_MTU, LINK_MTU = 1420, 1500
OLD_DEVICES = ("feos-pods", "feos-nat64")  # the first version's bridge, the NAT64 version's


class KeptValues(Protocol):
    """What the network reads of a store (feos._store.Store): never waits for a write."""

    def get(self, record_id: str) -> Any: ...
    def items(self) -> list[tuple[str, Any]]: ...
    def __contains__(self, record_id: object) -> bool: ...


# --- pure: what the network knows, and what the compiler and the resolver are given ----------


@attrs.frozen
class DnsRecord(DnsQuery):
    """A DnsQuery record with what the schema's DnsQuery carries beyond the traffic module's."""

    qtype_number: int = 0
    rcode_number: int = 0
    upstream: str = ""


def known_pods(view: Iterable[PodNet], prepared: Mapping[str, PodNet],
               removed: Container[str]) -> list[PodNet]:
    """The view's pods, each replaced by the one `prepare` was given, without those removed."""
    out = {p.id: p for p in view if p.id not in removed}
    out.update((i, p) for i, p in prepared.items() if i not in removed)
    return [out[i] for i in sorted(out)]


def pod_addresses(pod: PodNet, options: NetworkOptions) -> tuple[
    ipaddress.IPv6Address | None, ipaddress.IPv4Address | None
]:
    """The pod's addresses if they are of this network (the prefix, the range), else None."""
    v6 = _parse(pod.ipv6, ipaddress.IPv6Address)
    v4 = _parse(pod.ipv4, ipaddress.IPv4Address)
    prefix = options.pod_prefix
    return (v6 if v6 is not None and prefix is not None and v6 in prefix else None,
            v4 if v4 is not None and v4 in options.ipv4_range else None)


def _parse(text: str, kind: type[Any]) -> Any:
    try:
        return kind(text) if text else None
    except ValueError:
        return None


def table_pods(pods: Iterable[PodNet], options: NetworkOptions,
               groups: Container[str]) -> tuple[list[nft.PodNet], list[str]]:
    """The compiler's pods, and the IDs left out: without this network's addresses, with an ID
    that names no TAP, or naming a group the node lacks (such a pod cannot boot; leaving it out
    keeps one pod's missing group from failing every pod's table)."""
    out: list[nft.PodNet] = []
    left: list[str] = []
    for pod in pods:
        v6, v4 = pod_addresses(pod, options)
        tap = tap_or_none(pod.id)
        if v6 is None or v4 is None or tap is None or missing_groups(pod, groups):
            left.append(pod.id)
            continue
        out.append(nft.PodNet(tap, v6, v4, tuple(pod.security_groups),
                              local_metadata=pod.driver == "qemu", published=pod.published))
    return out, left


def relay_targets(pods: Iterable[PodNet], options: NetworkOptions) -> dict[int, tuple[str, int]]:
    """The ::1 relay's ports: each TCP publish of every address, all IPv6 or ::1, to the pod."""
    out: dict[int, tuple[str, int]] = {}
    for pod in pods:
        v6, _ = pod_addresses(pod, options)
        for p in pod.published:
            if v6 is not None and p.protocol == "tcp" and p.host_address in ("", "::", "::1"):
                out[p.host_port] = (str(v6), p.pod_port)
    return out


def tap_or_none(pod_id: str) -> str | None:
    try:
        return tap_name(pod_id)
    except FeosError:
        return None


@attrs.frozen
class MeshFacts:
    """What the table takes of the mesh: its peers' endpoints (denied to pods) and the ULA."""

    endpoints: tuple[Addr, ...] = ()
    ula: ipaddress.IPv6Network | None = None


def node_facts(options: NetworkOptions, node_addresses: Sequence[Addr],
               mesh: MeshFacts = MeshFacts()) -> nft.NodeFacts:
    prefix = options.require_network()
    return nft.NodeFacts(prefix, options.ipv4_range, options.dns_address, options.otlp_address,
                         tuple(options.deny_prefixes), tuple(node_addresses),
                         mesh_endpoints=mesh.endpoints, mesh_prefix=mesh.ula)


def compile_for(pods: Iterable[PodNet], options: NetworkOptions,
                groups: Mapping[str, SecurityGroup], node_addresses: Sequence[Addr],
                mesh: MeshFacts = MeshFacts()) -> nft.Table:
    """The whole table for these pods, groups, node addresses and mesh."""
    chosen, _ = table_pods(pods, options, groups)
    return nft.compile_table(chosen, groups, node_facts(options, node_addresses, mesh))


def dns_pods(pods: Iterable[PodNet], options: NetworkOptions) -> dict[
    ipaddress.IPv4Address, PodDns
]:
    """The resolver's pods by their IPv4 address; an upstream that does not parse is left out
    (check_spec refused it at create: only a record of an older feosd can hold one)."""
    out: dict[ipaddress.IPv4Address, PodDns] = {}
    for pod in pods:
        _, v4 = pod_addresses(pod, options)
        if v4 is None:
            continue
        ups = tuple(a for a in (_parse_ip(u) for u in pod.dns_upstreams) if a is not None)
        out[v4] = PodDns(pod.id, tuple(pod.name_tables), ups)
    return out


def _parse_ip(text: str) -> Addr | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def missing_groups(pod: PodNet, groups: Container[str]) -> list[str]:
    return [g for g in pod.security_groups if g not in groups]


def missing_reason(pod: PodNet, groups: Container[str], tables: Container[str]) -> str | None:
    """Why the pod cannot boot or resume here: the groups and tables the node lacks, or None."""
    lacks = []
    if gs := missing_groups(pod, groups):
        lacks.append(f"the security groups {', '.join(gs)}")
    if ts := [t for t in pod.name_tables if t not in tables]:
        lacks.append(f"the name tables {', '.join(ts)}")
    return f"pod {pod.id}: the node does not have {' and '.join(lacks)}" if lacks else None


def guest_network_of(pod: PodNet, options: NetworkOptions, *,
                     meshed: bool = False) -> GuestNetwork:
    """On a mesh a pod's packets go through WireGuard: its MTU, 1420, is the pod's."""
    v6 = ipaddress.IPv6Address(pod.ipv6)
    return GuestNetwork(ipv6=str(v6), ipv4=pod.ipv4, resolver=str(options.dns_address),
                        ula_only=v6 in ULA, mtu=MESH_MTU if meshed and v6 in ULA else LINK_MTU)


def metadata_of(pod: PodNet) -> dict[str, Any]:
    """The object the metadata service holds for the pod (its spec's metadata checked at create;
    a record that holds no object gives an empty one)."""
    try:
        spec = json.loads(pod.metadata_json) if pod.metadata_json else {}
    except ValueError:
        spec = {}
    return metadata_object(pod.id, pod.ipv6, pod.ipv4, spec if isinstance(spec, dict) else {})


_RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


def dns_record(q: QueryRecord) -> DnsRecord:
    """A resolver's record of an answered query as a traffic record."""
    return DnsRecord(q.pod or "", q.name, type_name(q.qtype), _RCODES.get(q.rcode, str(q.rcode)),
                        tuple(q.answers), q.time, qtype_number=q.qtype, rcode_number=q.rcode,
                        upstream=q.upstream or "")


def read_node_addresses(ipr: IPRoute) -> tuple[Addr, ...]:
    """The node's own global addresses (link-local and loopback ones are denied anyway)."""
    found: set[Addr] = set()
    for m in ipr.get_addr():
        text = m.get("IFA_ADDRESS")
        addr = _parse_ip(text.split("%")[0]) if text else None
        if addr is not None and not (addr.is_link_local or addr.is_loopback):
            found.add(addr)
    return tuple(sorted(found, key=lambda a: (a.version, int(a))))


def pod_links(ipr: IPRoute) -> dict[str, int]:
    """The node's pod-* devices by name, with their ifindex."""
    out = {}
    for link in ipr.get_links():
        name = link.get("IFLA_IFNAME") or ""
        if name.startswith("pod-"):
            out[name] = link["index"]
    return out


def remove_old_devices(ipr: IPRoute) -> list[str]:
    gone = []
    for name in OLD_DEVICES:
        found = ipr.link_lookup(ifname=name)
        if found:
            ipr.link("del", index=found[0])
            gone.append(name)
    return gone


class StoreMapping(Mapping[str, Any]):
    """A store read as a mapping, for the resolver: lookups of what is kept, never a copy."""

    def __init__(self, store: KeptValues) -> None:
        self._store = store

    def __getitem__(self, key: str) -> Any:
        value = self._store.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self._store.get(key)
        return default if value is None else value

    def __iter__(self) -> Iterator[str]:
        return iter([k for k, _ in self._store.items()])

    def __len__(self) -> int:
        return len(self._store.items())


def store_of(service_or_store: Any) -> KeptValues:
    """SecurityGroupService and NameTableService keep theirs in `.store`; a store is taken as is."""
    return getattr(service_or_store, "store", service_or_store)  # type: ignore[no-any-return]
