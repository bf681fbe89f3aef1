"""The pods' network on a mesh, in a throwaway node namespace: feos.net's Network with a Mesh and
no --pod-prefix waits for JoinMesh's /96 (feosd serving meanwhile), comes up with it as its pod
prefix, and writes the mesh into its table; with --pod-prefix a meshed cluster fails its pods."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from test_netservice_node import TAPPED, View, pod, stores  # noqa: F401 (its fixture)

from conftest import Netns
from feos.errors import Code, FeosError
from feos.net import Mesh, Network, UapiDevice, parse_network_options
from feos.net._service import EXCLUDED_REASON, MESH_WAIT_REASON

ULA, OWN = "fd12:3456:789a:1::/64", "fd12:3456:789a:1:0:1::/96"


async def test_the_network_comes_up_with_the_meshs_prefix(
        make_netns: Callable[[str], Netns], tmp_path: Path,
        stores: Any) -> None:  # noqa: F811 (the fixture imported above)
    groups, names = stores
    node = make_netns("mn")
    mesh = Mesh(tmp_path / "node" / "mesh", tmp_path / "run", 51820, netns=node.name)
    net = Network(parse_network_options(), tmp_path, View(), groups, names, netns=node.name,
                  table_interval=3600, mesh=mesh)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(net.run)  # told at once: feosd does not wait for the prefix
            assert net.unavailable() == MESH_WAIT_REASON
            with pytest.raises(FeosError) as e:
                net.check_spec(pod(TAPPED))
            assert e.value.code == Code.FAILED_PRECONDITION
            await net.take_mesh({"meshed": True, "ula": ULA, "prefix": OWN})
            with trio.fail_after(20):
                while net.unavailable() is not None:  # noqa: ASYNC110 (the network's own task)
                    await trio.sleep(0.05)
            assert str(net.options.pod_prefix) == OWN
            routes = node.run("ip", "-6", "route", "show").stdout
            assert f"unreachable {OWN}" in routes and f"{ULA} dev feos-mesh" in routes
            await mesh.put_mesh_peers({"version": 1, "peers": [{
                "publicKey": os.urandom(32), "endpoint": "192.0.2.77:51820",
                "prefix": "fd12:3456:789a:1:0:2::/96"}]})
            deny4 = ("nft", "list", "set", "inet", "feos", "deny4")
            with trio.fail_after(10):
                while "192.0.2.77" not in node.run(*deny4).stdout:  # noqa: ASYNC110 (its task)
                    await trio.sleep(0.05)
            prerouting = node.run("nft", "list", "chain", "inet", "feos", "prerouting").stdout
            assert f"ip6 saddr {ULA} fib saddr . iif oif missing" in prerouting
            allocated = await net.allocate(pod(TAPPED))
            assert allocated.ipv6.startswith("fd12:3456:789a:1:0:1:")
            assert net.guest_network(allocated).mtu == 1420
            nursery.cancel_scope.cancel()
    finally:
        assert isinstance(mesh.device, UapiDevice)
        mesh.device.stop()
        if net.dns_sockets is not None:
            net.dns_sockets.close()


async def test_a_pod_prefix_in_a_meshed_cluster_fails_the_pods(
        tmp_path: Path, stores: Any) -> None:  # noqa: F811 (the fixture imported above)
    groups, names = stores
    net = Network(parse_network_options(pod_prefix="fd00:1::/64"), tmp_path, View(), groups,
                  names)  # not run: the answer alone decides
    await net.take_mesh({"meshed": False})
    assert net.unavailable() != EXCLUDED_REASON
    await net.take_mesh({"meshed": True, "ula": ULA, "prefix": ""})
    assert net.unavailable() == EXCLUDED_REASON
