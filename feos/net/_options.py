"""The pods' network options (node.md, "The pods' network") and the rules between them.

`parse_network_options` takes the values as the command line gave them (strings) and returns
either NetworkOptions or raises FeosError(INVALID_ARGUMENT) naming the option and the rule.
A node without --pod-prefix is not an error: its options say why pods with a network fail
(`unavailable_reason`), and feosd runs on.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import attrs

from feos.errors import Code, FeosError, invalid

IPv4Net = ipaddress.IPv4Network
IPv6Net = ipaddress.IPv6Network
Net = IPv4Net | IPv6Net
Addr = ipaddress.IPv4Address | ipaddress.IPv6Address

# The pod's IPv4 gateway, which the kernel answers by proxy: the node never holds it.
GATEWAY4 = ipaddress.IPv4Address("169.254.0.1")
# The metadata service's address, which the pods reach on their own link.
METADATA4 = ipaddress.IPv4Address("169.254.169.254")
GATEWAY6 = ipaddress.IPv6Address("fe80::1")

DEFAULT_IPV4_RANGE = "169.254.16.0/20"
DEFAULT_DNS_ADDRESS = "169.254.0.53"
DEFAULT_OTLP_ADDRESS = "169.254.169.1"
DEFAULT_DNS_UPSTREAMS = ("2001:4860:4860::8888", "2606:4700:4700::1111", "8.8.8.8", "1.1.1.1")

NO_PREFIX_REASON = (
    "the node has no pods' network: feosd was started without --pod-prefix (and no mesh "
    "gave it a prefix)"
)


@attrs.frozen
class NetworkOptions:
    """The pods' network as the options set it; `pod_prefix` None means pods have no network."""

    pod_prefix: IPv6Net | None
    ipv4_range: IPv4Net
    dns_address: ipaddress.IPv4Address
    otlp_address: ipaddress.IPv4Address
    dns_upstreams: tuple[Addr, ...]
    deny_prefixes: tuple[Net, ...]

    @property
    def unavailable_reason(self) -> str | None:
        """Why pods with a network fail on this node, or None when they can have one."""
        return NO_PREFIX_REASON if self.pod_prefix is None else None

    def require_network(self) -> IPv6Net:
        """The pod prefix, or FAILED_PRECONDITION with the reason a pod cannot have a network."""
        if self.pod_prefix is None:
            raise FeosError(Code.FAILED_PRECONDITION, NO_PREFIX_REASON)
        return self.pod_prefix


def _network(option: str, text: str) -> Net:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise invalid(option, f"must be a prefix with no host bits set ({e})") from None


def _address(option: str, text: str) -> Addr:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise invalid(option, f"{text!r} is not an IP address") from None


def _pod_prefix(text: str | None) -> IPv6Net | None:
    if text is None:
        return None
    net = _network("--pod-prefix", text)
    if not isinstance(net, IPv6Net):
        raise invalid("--pod-prefix", "must be an IPv6 prefix")
    if not 1 <= net.prefixlen <= 120:
        raise invalid("--pod-prefix", f"must be /1 to /120, not /{net.prefixlen}")
    return net


def _ipv4(option: str, text: str) -> ipaddress.IPv4Address:
    addr = _address(option, text)
    if not isinstance(addr, ipaddress.IPv4Address):
        raise invalid(option, "must be an IPv4 address")
    return addr


def _ipv4_range(text: str, dns: ipaddress.IPv4Address) -> IPv4Net:
    net = _network("--pod-ipv4-range", text)
    if not isinstance(net, IPv4Net):
        raise invalid("--pod-ipv4-range", "must be an IPv4 prefix")
    if not 1 <= net.prefixlen <= 30:
        raise invalid("--pod-ipv4-range", f"must be /1 to /30, not /{net.prefixlen}")
    for addr, what in ((dns, "the resolver's address"), (GATEWAY4, "169.254.0.1")):
        if addr in net:
            raise invalid("--pod-ipv4-range", f"must not contain {what} ({addr})")
    return net


def _otlp(
    text: str, dns: ipaddress.IPv4Address, rng: IPv4Net, deny: Sequence[Net]
) -> ipaddress.IPv4Address:
    addr = _ipv4("--otlp-address", text)
    forbidden = {
        GATEWAY4: "169.254.0.1 (the pods' gateway)",
        dns: "the resolver's address",
        METADATA4: "169.254.169.254 (the metadata service)",
    }
    if addr in forbidden:
        raise invalid("--otlp-address", f"must not be {forbidden[addr]}")
    if addr in rng:
        raise invalid("--otlp-address", f"must not be in the pods' IPv4 range {rng}")
    for net in deny:
        if addr in net:
            raise invalid("--otlp-address", f"must not be in the denied prefix {net}")
    return addr


def parse_network_options(
    *,
    pod_prefix: str | None = None,
    pod_ipv4_range: str = DEFAULT_IPV4_RANGE,
    dns_address: str = DEFAULT_DNS_ADDRESS,
    otlp_address: str = DEFAULT_OTLP_ADDRESS,
    dns_upstreams: Sequence[str] = (),
    deny_prefixes: Sequence[str] = (),
) -> NetworkOptions:
    """Check the options against node.md's rules; the first broken rule raises INVALID_ARGUMENT."""
    prefix = _pod_prefix(pod_prefix)
    dns = _ipv4("--dns-address", dns_address)
    if dns == GATEWAY4:
        raise invalid("--dns-address", "must never be 169.254.0.1 (the pods' gateway)")
    rng = _ipv4_range(pod_ipv4_range, dns)
    deny = tuple(_network("--deny-prefix", d) for d in deny_prefixes)
    otlp = _otlp(otlp_address, dns, rng, deny)
    ups = tuple(_address("--dns-upstream", u) for u in (dns_upstreams or DEFAULT_DNS_UPSTREAMS))
    return NetworkOptions(prefix, rng, dns, otlp, ups, deny)


def add_network_arguments(parser: object) -> None:
    """Add the options to an argparse parser (feosd's main calls this)."""
    add = parser.add_argument  # type: ignore[attr-defined]
    add("--pod-prefix", default=None, help="the IPv6 prefix routed to the node, /1 to /120")
    add("--pod-ipv4-range", default=DEFAULT_IPV4_RANGE, help="the pods' IPv4 addresses")
    add("--dns-address", default=DEFAULT_DNS_ADDRESS, help="the pods' resolver (IPv4)")
    add("--otlp-address", default=DEFAULT_OTLP_ADDRESS, help="where pods send OTLP spans")
    add("--dns-upstream", action="append", default=[], help="an upstream resolver (repeatable)")
    add("--deny-prefix", action="append", default=[], help="what no pod reaches (repeatable)")


def network_options_from_args(args: object) -> NetworkOptions:
    """NetworkOptions from the namespace that add_network_arguments's parser returned."""
    return parse_network_options(
        pod_prefix=args.pod_prefix,  # type: ignore[attr-defined]
        pod_ipv4_range=args.pod_ipv4_range,  # type: ignore[attr-defined]
        dns_address=args.dns_address,  # type: ignore[attr-defined]
        otlp_address=args.otlp_address,  # type: ignore[attr-defined]
        dns_upstreams=args.dns_upstream,  # type: ignore[attr-defined]
        deny_prefixes=args.deny_prefix,  # type: ignore[attr-defined]
    )
