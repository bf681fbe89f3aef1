"""The pod service's side of the pods' network: a pod as the network sees it, and the checks.

The network (feos.pods._network.PodNetworkService) may be missing (no --pod-prefix, a setup that
failed) or attached after the pods were loaded, since its table is made from them. Pods without a
network never reach it; every method here is a no-op for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import Code, FeosError
from ._network import Link, PodNet, PodNetworkService
from ._pod import Pod
from ._ports import Named, NetworkConfig


class NetworkFace:
    def __init__(self, network: PodNetworkService | None, reason: str, *,
                 groups: Named | None = None, tables: Named | None = None,
                 driver_for: Callable[[str], str] | None = None) -> None:
        self.network = network
        self._driver_for = driver_for
        self.reason = reason  # why there is no network, while there is none
        self._groups = groups
        self._tables = tables

    def net(self, pod: Pod) -> PodNet:
        network = pod.spec.network
        assert network is not None
        driver = pod.driver or self._node_driver(pod.id)
        return PodNet(pod.id, pod.ipv6, pod.ipv4, network.security_groups, network.name_tables,
                      network.dns_upstreams, pod.spec.metadata_json, driver,
                      published=network.publish)

    def _node_driver(self, pod_id: str) -> str:
        """The VMM a pod not yet prepared would boot on; "" while feosd's VMM probe runs (its
        bring-up's prepare names it then)."""
        if self._driver_for is None:
            return ""
        try:
            return self._driver_for(pod_id)
        except FeosError:
            return ""

    def pods(self, pods: Iterable[Pod]) -> list[PodNet]:
        return [self.net(p) for p in pods if p.spec.network is not None]

    def changed(self) -> None:
        if self.network is not None:
            self.network.pods_changed()

    def check_can_make(self, pod: Pod) -> None:
        """At create: FAILED_PRECONDITION while the network is missing or unavailable, and the
        network's own checks of the spec (INVALID_ARGUMENT naming the field)."""
        if pod.spec.network is None:
            return
        reason = self.reason if self.network is None else self.network.unavailable()
        if reason is not None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pods with a network cannot be made: {reason}")
        assert self.network is not None
        self.network.check_spec(self.net(pod))

    def check_named(self, pod: Pod) -> None:
        """A pod whose groups or name tables the node lacks does not boot or resume."""
        network = pod.spec.network
        if network is None:
            return
        missing = [f"security group {g}" for g in network.security_groups
                   if self._groups is not None and g not in self._groups.store]
        missing += [f"name table {t}" for t in network.name_tables
                    if self._tables is not None and t not in self._tables.store]
        if missing:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pod {pod.id} names what the node does not have: {', '.join(missing)}")

    async def allocate(self, pod: Pod) -> bool:
        """The pod's addresses (kept ones kept); whether they changed."""
        if pod.spec.network is None or self.network is None:
            return False
        net = await self.network.allocate(self.net(pod))
        if (net.ipv6, net.ipv4) == (pod.ipv6, pod.ipv4):
            return False
        pod.ipv6, pod.ipv4 = net.ipv6, net.ipv4
        return True

    async def prepare(self, pod: Pod, *, boot: bool = True) -> Link | None:
        """Before a boot (FAILED_PRECONDITION without a network) or a resume: the pod's link."""
        if pod.spec.network is None or (self.network is None and not boot):
            return None
        if self.network is None:
            raise FeosError(Code.FAILED_PRECONDITION, self.reason)
        return await self.network.prepare(self.net(pod))

    async def remove(self, pod: Pod) -> None:
        if pod.spec.network is not None and self.network is not None:
            await self.network.remove(self.net(pod))

    def guest_config(self, pod: Pod) -> NetworkConfig | None:
        """The guest's network configuration, pushed after an attach and a resume."""
        if pod.spec.network is None or self.network is None or not pod.ipv6:
            return None
        config = self.network.guest_network(self.net(pod))
        return NetworkConfig(ipv6=config.ipv6, ipv4=config.ipv4, resolvers=(config.resolver,),
                             mtu=config.mtu)


def naming(pods: Iterable[Pod], *, group: str = "", table: str = "") -> list[str]:
    """The pods whose spec names the security group or the name table."""
    return [p.id for p in pods if p.spec.network is not None
            and (group in p.spec.network.security_groups or table in p.spec.network.name_tables)]
