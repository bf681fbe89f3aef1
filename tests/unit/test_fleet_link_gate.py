"""The link's thread waits for the resumes of a suspend-on-stop (or two minutes) before it joins;
JoinMesh of a node with --pod-prefix only asks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from feos.fleet import EventBuffer, Link, LinkConfig, Runtime
from feos.fleet import _link as link_module
from feos.fleet._uplink import Uplink


def config(tmp_path: Path, **kw: object) -> LinkConfig:
    return LinkConfig(control_plane="127.0.0.1:9", server_name="cp.test",
                      trust_domain="feos.local", token_file=tmp_path / "token",
                      node_dir=tmp_path / "node", name="n1", **kw)  # type: ignore[arg-type]


def make_link(tmp_path: Path) -> Link:
    runtime = Runtime(pods=None, host=None, events=EventBuffer(), mesh_dir=tmp_path / "mesh")
    return Link(config(tmp_path), runtime, None, lambda a, n: (a, n))


def wait_state(link: Link, state: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while link.uplink.status.state != state:
        assert time.monotonic() < deadline, link.uplink.status.state
        time.sleep(0.02)


def test_the_join_waits_for_the_resumes(tmp_path: Path) -> None:
    link = make_link(tmp_path)
    link.start()
    try:
        time.sleep(0.5)
        assert link.uplink.status.state == "waiting for the resumes"
        assert [e.kind for e in link.runtime.events.pending()] == ["started"]
        link.resumes_done()
        wait_state(link, "joining")
    finally:
        link.stop_blocking(1.0)
        link.stop_blocking(1.0)
    assert link.uplink.status.state == "stopped"


def test_the_join_starts_after_two_minutes_without_the_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_module, "RESUMES_WAIT_S", 0.3)
    link = make_link(tmp_path)
    link.start()
    try:
        wait_state(link, "joining")
    finally:
        link.stop_blocking(1.0)


def test_a_node_with_a_pod_prefix_sends_no_key(tmp_path: Path) -> None:
    runtime = Runtime(pods=None, host=None, events=EventBuffer(), mesh_dir=tmp_path / "mesh")
    uplink = Uplink(config(tmp_path, pod_prefix=True), runtime, None, runtime.events,
                    lambda a, n: (a, n))
    assert uplink._mesh_request(None) == (b"", "")  # type: ignore[arg-type]
    assert not (tmp_path / "mesh" / "key").exists()


def test_the_mesh_key_is_made_once(tmp_path: Path) -> None:
    runtime = Runtime(pods=None, host=None, events=EventBuffer(), mesh_dir=tmp_path / "mesh")
    key = runtime.mesh_key()
    again = Runtime(pods=None, host=None, events=EventBuffer(), mesh_dir=tmp_path / "mesh")
    assert len(key) == 32 and again.mesh_key() == key
    assert (tmp_path / "mesh" / "key").stat().st_mode & 0o777 == 0o600
