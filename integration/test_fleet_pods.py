"""A real pod created and deleted by calls the test control plane pushes over feosd's node
connection, its events reaching the control plane over the uplink (boots one microVM: run
under /tmp/feos-vm.lock)."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _owner import OWNER
from feosd_proc import Feosd, end_microvms

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from controlplane import ControlPlane

pytestmark = pytest.mark.integration
POD = "fk00000001a"
SPEC = {"network": {"none": None}, "memoryMib": 256}


def test_pushed_calls_create_and_delete_a_real_pod(tmp_path: Path) -> None:
    # in a namespace of its own: feosd there is on a mesh, whose device and routes stay in it
    ns = OWNER.netns(f"feostest-fleetpods-{secrets.token_hex(3)}")
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    with ControlPlane(tmp_path / "cp", netns=ns) as cp:
        (tmp_path / "join-token").write_text(cp.token())
        feosd = Feosd(tmp_path / "node", "--control-plane", cp.address, "--control-plane-name",
                      cp.ca.server_name, "--join-token-file", str(tmp_path / "join-token"),
                      netns=ns)
        try:
            feosd.start()
            cp.wait_for(lambda: cp.node_connections, why="a node connection")
            created = cp.push("pods", "createPod", {"id": POD, "spec": SPEC})
            assert created["status"]["code"] == "ok", created
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                pod = cp.push("pods", "getPod", {"id": POD})["pod"]
                if pod["state"] in ("running", "failed"):
                    break
                time.sleep(1)
            assert pod["state"] == "running", pod
            states = lambda: [e["state"] for e in cp.events if e.get("podId") == POD]  # noqa: E731
            cp.wait_for(lambda: "running" in states(), why="the pod's events")
            cp.wait_for(lambda: any(POD in [p["id"] for p in r["telemetry"]["pods"]]
                                    for r in cp.reports), why="the pod in a report")
            deleted = cp.push("pods", "deletePod", {"id": POD}, timeout=120)
            assert deleted["status"]["code"] == "ok", deleted
            cp.wait_for(lambda: any(e.get("podId") == POD and e["deleted"] for e in cp.events),
                        timeout=120, why="the pod's deletion as an event")
            assert feosd.ctl("--json", "pod", "get", POD, check=False).returncode == 15
            assert feosd.stop(60) == 0
        finally:
            feosd.close()
            end_microvms(feosd.state_dir)
            OWNER.done(ns)
    assert socket.gethostname() in [name for _, name in cp.joins]
