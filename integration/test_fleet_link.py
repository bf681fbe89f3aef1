"""feosd against the test control plane (tests/controlplane.py): the join, the uplink, the stop.

A real feosd process with --control-plane at the test control plane on loopback; no microVM
boots (the reports list no pods), so these need no VM lock.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _owner import OWNER
from feosd_proc import Feosd

from feos.fleet._nodeconn import stop_message

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from controlplane import ControlPlane
from controlplane_ca import TestCA

pytestmark = pytest.mark.integration
NAME = socket.gethostname()


@pytest.fixture
def ns() -> Iterator[str]:
    """Each test's control plane and feosd in a network namespace of their own: feosd there is
    on a mesh (--control-plane without --pod-prefix), whose device and routes stay in it."""
    name = OWNER.netns(f"feostest-fleet-{secrets.token_hex(3)}")
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    yield name
    OWNER.done(name)


@pytest.fixture
def cp(tmp_path: Path, ns: str) -> Iterator[ControlPlane]:
    with ControlPlane(tmp_path / "cp", netns=ns) as plane:
        yield plane


def node(tmp_path: Path, cp: ControlPlane, token: str, *extra: str, **env: str) -> Feosd:
    token_file = tmp_path / "join-token"
    token_file.write_text(token + "\n")
    return Feosd(tmp_path / "node", "--control-plane", cp.address, "--control-plane-name",
                 cp.ca.server_name, "--join-token-file", str(token_file), *extra,
                 env={"FEOSD_TEST_HOOKS": "1", **env}, netns=cp.netns)


def kinds(cp: ControlPlane) -> list[str]:
    return [e["kind"] for e in cp.events]


def test_join_reports_events_mesh_and_the_stop(tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token()).start() as feosd:
        cp.wait_for(lambda: cp.joins, why="a join")
        assert cp.joins == [("s3cret", NAME)]
        cp.wait_for(lambda: len(cp.reports) >= 2, why="two reports")
        report = cp.reports[-1]
        assert report["telemetry"]["node"]["pid"] == feosd.proc.pid
        assert report["telemetry"]["versions"]["feosd"]
        assert report["sequence"] >= 2
        cp.wait_for(lambda: "started" in kinds(cp), why="the started event")
        assert cp.events[0]["sequence"] == 1
        cp.wait_for(lambda: cp.mesh_calls, why="JoinMesh")
        mesh_call = cp.mesh_calls[0]
        assert len(mesh_call["publicKey"]) == 32 and mesh_call["endpoint"].endswith(":51820")
        assert not mesh_call["askOnly"]
        node_dir = feosd.state_dir / "node"
        assert stat.S_IMODE(node_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((node_dir / "key.pem").stat().st_mode) == 0o600
        for name in ("chain.pem", "bundle.pem", "node.json"):
            assert (node_dir / name).exists()
        cp.wait_for(lambda: (node_dir / "mesh" / "mesh.pb").exists(), why="mesh.pb")
        cp.wait_for(lambda: any(r["telemetry"]["meshTaken"] for r in cp.reports[1:]),
                    why="a report after the mesh's answer was taken")
        assert cp.wait_for(lambda: cp.node_connections, why="a node connection")
        pushed = cp.push("host", "getHostInfo")  # a call over the node connection
        assert pushed["info"]["pid"] == feosd.proc.pid
        shown = feosd.ctl_json("host", "control-plane")
        assert shown["identity"]["spiffeId"] == f"spiffe://feos.local/node/{NAME}"
        assert shown["uplink"]["state"] == "joined" and shown["uplink"]["meshPrefix"] == cp.prefix
        assert [c["state"] for c in shown["connections"]] == ["connected"]
        feosd.stop()
        assert feosd.proc.returncode == 0
    assert "stopping" in kinds(cp)
    assert "did not acknowledge" not in feosd.log_text()


def test_a_stop_tells_the_control_plane_and_ends_a_stream_with_unavailable(
        tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token(), "--stop-grace", "20").start() as feosd:
        cp.wait_for(lambda: cp.reports and cp.node_connections, why="a report and a connection")
        stream = cp.watch("pods", "watchEvents", {"podId": ""})
        assert stream["status"] is None  # a long-lived stream, in flight
        feosd.stop()
        assert feosd.proc.returncode == 0
        stopping = [e for e in cp.events if e["kind"] == "stopping"]
        assert len(stopping) == 1
        # the stream ended with the stop (within the calls' 2 s and the 5 s of the close)
        cp.wait_for(lambda: stream["status"] is not None, timeout=10, why="the stream's end")
        code, message = stream["status"]
        assert (code.name, message) == ("UNAVAILABLE", stop_message(2.0))
        assert "closing the node connections (their calls: 2s at most)" in feosd.log_text()
    assert "did not acknowledge" not in feosd.log_text()


def test_a_stop_waits_3s_at_most_for_the_acknowledgement(tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token()).start() as feosd:
        cp.wait_for(lambda: cp.reports, why="a report")
        cp.ack_events = False
        began = time.monotonic()
        assert feosd.stop() == 0
        took = time.monotonic() - began
    assert "stopping" in kinds(cp)  # sent, and sent again, but never acknowledged
    assert "did not acknowledge the stopping event within 3 s" in feosd.log_text()
    assert 3 <= took < 20


def test_the_same_key_after_a_restart_and_no_second_join(tmp_path: Path, cp: ControlPlane) -> None:
    first = node(tmp_path, cp, cp.token()).start()
    with first:
        cp.wait_for(lambda: cp.reports, why="a report")
        key = (first.state_dir / "node" / "key.pem").read_bytes()
        first.stop()
    reports = len(cp.reports)
    with node(tmp_path, cp, cp.token()).start() as second:
        cp.wait_for(lambda: len(cp.reports) > reports, why="a report of the second start")
        assert len(cp.joins) == 1
        assert (second.state_dir / "node" / "key.pem").read_bytes() == key
        assert len({e["startId"] for e in cp.events}) == 2


def test_a_failed_join_is_tried_again_with_the_same_key(tmp_path: Path, ns: str) -> None:
    with socket.socket() as s:  # a port nothing listens on, until the control plane starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cp = ControlPlane(tmp_path / "cp", port=port, netns=ns)
    with node(tmp_path, cp, cp.token()).start() as feosd:
        key_file = feosd.state_dir / "node" / "key.pem"
        cp.wait_for(lambda: "the join: UNAVAILABLE" in feosd.log_text(), why="a failed join")
        key = key_file.read_bytes()
        with cp:
            cp.wait_for(lambda: cp.joins, why="the join tried again")
            assert key_file.read_bytes() == key
            cp.wait_for(lambda: cp.reports, why="a report")


def test_the_uplink_moves_past_an_instance_that_fails(tmp_path: Path, cp: ControlPlane) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with node(tmp_path, cp, cp.token()).start() as feosd:
        cp.wait_for(lambda: cp.reports, why="a report")
        cp.instances = [{"address": dead}, {"address": cp.address}]
        info = feosd.state_dir / "node" / "node.json"
        cp.wait_for(lambda: dead in info.read_text(), why="the instances kept in node.json")
        reports = len(cp.reports)
        cp.wait_for(lambda: len(cp.reports) >= reports + 3, why="reports past the dead instance")
        shown = feosd.ctl_json("host", "control-plane")
        assert sorted(c["address"] for c in shown["connections"]) == sorted([dead, cp.address])


def test_a_wrong_pin_sends_no_secret(tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token(pin=TestCA().pin)).start() as feosd:
        cp.wait_for(lambda: "root check" in feosd.log_text(), why="the refusal's log line")
        assert cp.joins == [] and cp.refused == []
        assert feosd.ctl("host", "info").returncode == 0  # the node serves on


def test_a_wrong_uri_sends_no_secret(tmp_path: Path, ns: str) -> None:
    ca = TestCA(server_uris=["spiffe://feos.local/other"])
    with ControlPlane(tmp_path / "cp", ca=ca, netns=ns) as cp:
        with node(tmp_path, cp, cp.token()).start() as feosd:
            cp.wait_for(lambda: "uri check" in feosd.log_text(), why="the refusal's log line")
            assert cp.joins == [] and cp.refused == []


def test_a_refused_token_is_sent_again_only_once_it_changes(tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token("wrong")).start() as feosd:
        cp.wait_for(lambda: cp.refused, why="the refused join")
        token_file = tmp_path / "join-token"
        token_file.write_text(cp.token("wrong") + "\n")  # the same token, written again
        time.sleep(5)
        assert cp.refused == ["wrong"] and cp.joins == []
        token_file.write_text(cp.token() + "\n")
        cp.wait_for(lambda: cp.joins, why="the join on the new token")
        cp.wait_for(lambda: cp.reports, why="a report")
        feosd.stop()


def test_renewals_keep_the_key_and_the_reports(tmp_path: Path, ns: str) -> None:
    with ControlPlane(tmp_path / "cp", renew_in_s=2, netns=ns) as cp, \
            node(tmp_path, cp, cp.token()).start() as feosd:
        key = cp.wait_for(lambda: (feosd.state_dir / "node" / "key.pem").exists() and
                          (feosd.state_dir / "node" / "key.pem").read_bytes())
        cp.wait_for(lambda: cp.node_connections, why="a node connection")
        cp.wait_for(lambda: cp.renewals >= 2, why="two renewals")
        # the node connections dial anew with the new certificate
        cp.wait_for(lambda: cp.node_connections >= 2, why="a node connection after a renewal")
        reports = len(cp.reports)
        cp.wait_for(lambda: len(cp.reports) > reports + 1, why="reports after the renewals")
        assert (feosd.state_dir / "node" / "key.pem").read_bytes() == key
        assert len(cp.joins) == 1


def test_a_renewal_leaves_calls_in_flight_to_end_on_the_old_connection(tmp_path: Path,
                                                                       ns: str) -> None:
    with ControlPlane(tmp_path / "cp", renew_in_s=8, netns=ns) as cp, \
            node(tmp_path, cp, cp.token()).start():
        cp.wait_for(lambda: cp.node_connections, why="a node connection")
        stream = cp.watch("pods", "watchEvents", {"podId": ""})  # on the first connection
        cp.wait_for(lambda: cp.renewals, timeout=20, why="a renewal")
        cp.wait_for(lambda: cp.node_connections >= 2, why="a connection with the new certificate")
        assert cp.push("host", "getHostInfo")["info"]["hostname"]  # over the new connection
        time.sleep(2)
        assert stream["status"] is None  # the old connection drains: its stream goes on


def test_a_removed_node_joins_again_on_a_new_token(tmp_path: Path, cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token()).start() as feosd:
        cp.wait_for(lambda: cp.reports, why="a report")
        cp.removed.add(NAME)
        node_dir = feosd.state_dir / "node"
        cp.wait_for(lambda: list(node_dir.glob("removed-*/key.pem")), why="the identity moved")
        time.sleep(3)
        assert len(cp.joins) == 1  # the old token is not sent again
        cp.tokens.add("second")
        (tmp_path / "join-token").write_text(cp.token("second"))
        cp.wait_for(lambda: len(cp.joins) == 2, why="the second join")
        assert cp.joins[1] == ("second", NAME)
        reports = len(cp.reports)
        cp.wait_for(lambda: len(cp.reports) > reports, why="reports after the second join")


def block_feosd(feosd: Feosd, seconds: float) -> None:
    (feosd.run_dir / "test-block-seconds").write_text(str(seconds))
    assert feosd.proc is not None
    os.kill(feosd.proc.pid, signal.SIGUSR2)


def test_a_blocked_main_loop_stops_neither_reports_nor_pings_for_30s(tmp_path: Path,
                                                                    cp: ControlPlane) -> None:
    with node(tmp_path, cp, cp.token()).start() as feosd:
        cp.wait_for(lambda: cp.reports and cp.node_connections, why="a report and a connection")
        pinger = cp.pushers[-1]
        block_feosd(feosd, 30)
        time.sleep(1)
        start, connections, pings = len(cp.reports), cp.node_connections, pinger.pings_seen
        time.sleep(27)
        assert len(cp.reports) - start >= 7  # every 3 s, with the pods as they were
        assert cp.node_connections == connections  # pinged on, never dropped
        assert pinger.pings_seen >= pings + 1  # feosd's own pings went on
        assert feosd.ctl("host", "info", timeout=60).returncode == 0


def test_the_90s_rule_holds_the_reports_and_lets_them_go(tmp_path: Path, cp: ControlPlane) -> None:
    # The rule's 90 s shortened to 20 (a test hook): the same code holds the reports, sooner.
    with node(tmp_path, cp, cp.token(), FEOSD_TEST_HELD_S="20").start() as feosd:
        cp.wait_for(lambda: cp.reports, why="a report")
        block_feosd(feosd, 30)
        blocked = time.monotonic()
        time.sleep(25)
        held_from = len(cp.reports)
        time.sleep(4)
        assert len(cp.reports) == held_from  # none past 20 s
        assert [r for r in cp.reports if r["at"] - blocked < 18]
        cp.wait_for(lambda: len(cp.reports) > held_from, timeout=20, why="the reports resumed")
