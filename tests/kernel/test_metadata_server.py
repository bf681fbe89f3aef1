"""The QEMU pods' metadata service answering curl from a pod's namespace over a real link.

A veth named pod-... stands for the TAP: make_tap finds the link there and sets it up exactly as
a TAP (the same code path). The node's namespace has an uplink with a default route, as a node
does, so that the kernel answers ARP for 169.254.0.1 by proxy.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import trio

from feos.net._links import TapSpec, make_tap, prepare_node
from feos.net._metadata_server import MetadataServer
from feos.net._mmds import metadata_object
from feos.net._options import parse_network_options

OPTIONS = parse_network_options(pod_prefix="2001:db8:1::/64")


async def _curl(ns: Any, *argv: str, wait: str = "3") -> tuple[int, str]:
    done = await trio.run_process(["ip", "netns", "exec", ns.name, "curl", "-sS", "-m", wait,
                                   *argv], capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, done.stdout.decode()


def _pod_link(node: Any, pod: Any, tap: str, ipv4: str) -> TapSpec:
    node.run("ip", "link", "add", tap, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    pod.run("ip", "addr", "add", f"{ipv4}/32", "dev", "eth0")
    pod.run("ip", "link", "set", "eth0", "up")
    pod.run("ip", "route", "add", "169.254.0.1", "dev", "eth0")
    pod.run("ip", "route", "add", "default", "via", "169.254.0.1", "dev", "eth0")
    return TapSpec(tap, ipaddress.IPv6Address("2001:db8:1::2"), ipaddress.IPv4Address(ipv4),
                   OPTIONS.dns_address, OPTIONS.otlp_address)


async def test_metadata_answers_its_pod_only(make_netns: Any) -> None:
    node, pod, other = make_netns("node"), make_netns("pod"), make_netns("other")
    node.run("ip", "link", "add", "up0", "type", "veth", "peer", "name", "up1")
    node.run("ip", "link", "set", "up0", "up")
    node.run("ip", "link", "set", "up1", "up")
    node.run("ip", "addr", "add", "10.99.0.1/24", "dev", "up0")
    node.run("ip", "route", "add", "default", "via", "10.99.0.2")
    await prepare_node(OPTIONS, node.name)
    spec = _pod_link(node, pod, "pod-abcdefghjkm", "169.254.16.1")
    await make_tap(spec, node.name)
    spec2 = _pod_link(node, other, "pod-zzzzzzzzzzz", "169.254.16.2")
    spec2 = TapSpec(spec2.name, ipaddress.IPv6Address("2001:db8:1::3"), spec2.ipv4,
                    spec2.dns_address, spec2.otlp_address)
    await make_tap(spec2, node.name)

    server = MetadataServer(netns=node.name)
    data = metadata_object("abcdefghjkm", "2001:db8:1::2", "169.254.16.1", {"role": "web"})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await server.add_pod(spec.name, data)
        url = "http://169.254.169.254"
        rc, token = await _curl(pod, "-X", "PUT", f"{url}/latest/api/token",
                                "-H", "X-metadata-token-ttl-seconds: 60")
        assert rc == 0
        assert len(token) > 20
        auth = ["-H", f"X-metadata-token: {token}"]
        assert await _curl(pod, *auth, f"{url}/feos/ipv4") == (0, "169.254.16.1")
        assert await _curl(pod, *auth, f"{url}/metadata/role") == (0, "web")
        rc, body = await _curl(pod, *auth, "-H", "Accept: application/json", f"{url}/")
        assert json.loads(body) == data
        rc, code = await _curl(pod, "-o", "/dev/null", "-w", "%{http_code}", f"{url}/feos")
        assert code == "401"
        # The other pod's link has no listener: its connection gets no answer (not even a
        # reset: the node does not hold the address to send one from), and it never sees the
        # first pod's metadata.
        rc, body = await _curl(other, "-X", "PUT", f"{url}/latest/api/token",
                               "-H", "X-metadata-token-ttl-seconds: 60", wait="1")
        assert rc != 0
        assert body == ""
        await server.add_pod(spec2.name, metadata_object("zzzzzzzzzzz", "2001:db8:1::3",
                                                         "169.254.16.2", {}))
        rc, token2 = await _curl(other, "-X", "PUT", f"{url}/latest/api/token",
                                 "-H", "X-metadata-token-ttl-seconds: 60")
        assert rc == 0
        assert await _curl(other, "-H", f"X-metadata-token: {token2}",
                           f"{url}/feos/pod-id") == (0, "zzzzzzzzzzz")
        # A token is its pod's: the first pod's token does not open the second's.
        rc, code = await _curl(other, "-o", "/dev/null", "-w", "%{http_code}", *auth,
                               f"{url}/feos")
        assert code == "401"
        # A TAP made anew (a resume) has a new index: add_pod binds a new socket to it, and the
        # pod's tokens stay.
        node.run("ip", "link", "del", spec2.name)
        _pod_link(node, other, spec2.name, "169.254.16.2")
        await make_tap(spec2, node.name)
        await server.add_pod(spec2.name, metadata_object("zzzzzzzzzzz", "2001:db8:1::3",
                                                         "169.254.16.2", {"v": "2"}))
        assert await _curl(other, "-H", f"X-metadata-token: {token2}",
                           f"{url}/metadata/v") == (0, "2")
        server.remove_pod(spec.name)
        rc, _ = await _curl(pod, "-X", "PUT", f"{url}/latest/api/token",
                            "-H", "X-metadata-token-ttl-seconds: 60", wait="1")
        assert rc != 0
        nursery.cancel_scope.cancel()
    # The node itself does not hold 169.254.169.254: its own traffic to it is not ours.
    local = node.run("ip", "route", "get", "169.254.169.254").stdout
    assert "local" not in local.split()[0]
