"""Baked images with real parts: a pod bakes its image, a second pod starts on the layer, no pull.

feosd in integration/podnet.py's namespaces, and the diskd its harness starts beside it, with
moto's S3 server (integration/moto_s3.py) as its object store. Two microVMs in all, QEMU under TCG:

1. a pod created with --bake on the busybox image: its disk is made on the guest's blank data
   volume (`disk` blank:<guest>), it bakes at its bake point, and once its layer is in the
   object store its record names it (`baked`) and an event of the pod says so;
2. the registry is stopped, and a second pod created with --layer <that layer> comes up
   RUNNING: its container was made from the image on its disk, nothing was pulled; its record's
   `disk` names the layer, and the layer's manifest is in the bucket.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from feosd_proc import BIN
from moto_s3 import MotoS3, moto_s3
from podnet import IMAGE, PodNet

from feos.vmm import guest_root, newest_guest

pytestmark = pytest.mark.integration

BAKER, ON_LAYER = "pb0000000bb", "pk0000000cc"
BAKED_WAIT_S = 300.0


class Node:
    def __init__(self, net: PodNet, s3: MotoS3) -> None:
        self.net, self.s3 = net, s3


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("bake")
    with moto_s3(root) as s3:
        net = PodNet(root / "net")
        net.feosd.diskd.env.update(s3.env())  # the diskd feosd's harness starts first
        with net:
            yield Node(net, s3)


def _events(net: PodNet, pod_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "feosctl"), "--socket", str(net.feosd.socket), "--json",
                             "pod", "events", pod_id], stdout=subprocess.PIPE, text=True)


def _baked(net: PodNet, pod_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + BAKED_WAIT_S
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = net.ctl_json("pod", "get", pod_id)
        if pod.get("baked"):
            return pod
        time.sleep(1)
    raise AssertionError(f"no baked layer after {BAKED_WAIT_S:g}s: {pod}\n"
                         f"{net.feosd.log.read_text(errors='replace')[-3000:]}")


def test_a_pod_bakes_and_another_starts_on_its_layer_without_a_pull(node: Node) -> None:
    net = node.net
    version, _ = newest_guest(guest_root())
    watch = _events(net, BAKER)
    try:
        time.sleep(1)  # the watcher subscribed
        net.ctl("pod", "create", BAKER, "--image", IMAGE, "--bake", "--wait", "--cmd",
                "sleep", "600")
        baker = _baked(net, BAKER)
    finally:
        watch.terminate()
    out, _ = watch.communicate(timeout=30)
    layer = baker["baked"]
    assert baker["disk"] == f"blank:{version}"
    assert baker["state"] == "running"
    reasons = [json.loads(line).get("reason", "") for line in out.splitlines()]
    assert f"baked {layer} is in the object store" in reasons
    keys = [o["Key"] for o in node.s3.client().list_objects_v2(Bucket=node.s3.bucket)
            .get("Contents", [])]
    assert any(layer.removeprefix("sha256:") in key for key in keys), keys

    net.ctl("pod", "delete", BAKER)
    net.stop_registry()
    net.ctl("pod", "create", ON_LAYER, "--image", IMAGE, "--layer", layer, "--wait", "--cmd",
            "sleep", "600")
    pod = net.ctl_json("pod", "get", ON_LAYER)
    assert pod["state"] == "running", pod
    assert pod["disk"] == f"layer:{layer}"
    assert not pod.get("baked")
    assert [c["state"] for c in pod.get("containers", [])] == ["running"]
    assert net.exec(ON_LAYER, "echo", "from the baked layer").stdout == "from the baked layer\n"

