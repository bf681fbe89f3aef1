"""packaging/kubernetes: the manifests validated against Kubernetes's own API schema, offline
(kubernetes-validate, which bundles the OpenAPI schemas of each release; strict: an unknown
field fails), and the pod they make is the one node.md's "On Kubernetes" asks for, its command
lines parsed by feosd's and diskd's own option parsers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from feos.daemon import parse_args as feosd_args
from feos.disk._daemon import parse_args as diskd_args

HERE = Path(__file__).resolve().parents[2] / "packaging" / "kubernetes"
RESOURCES = ["namespace.yaml", "serviceaccount.yaml", "daemonset.yaml"]


def load(name: str) -> Any:
    return yaml.safe_load((HERE / name).read_text())


def pod_spec() -> Any:
    return load("daemonset.yaml")["spec"]["template"]["spec"]


def container(spec: Any, name: str) -> Any:
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


@pytest.mark.parametrize("name", RESOURCES)
def test_valid_for_the_newest_kubernetes(name: str) -> None:
    version = kubernetes_validate.latest_version()
    assert tuple(int(p) for p in version.split(".")[:2]) >= (1, 33)  # sidecars are GA since 1.33
    kubernetes_validate.validate(load(name), version, strict=True)


def test_the_validator_refuses_what_kubernetes_would() -> None:
    # not a validator that passes anything: a misspelt field and a wrong type fail
    version = kubernetes_validate.latest_version()
    wrong = load("daemonset.yaml")
    container(wrong["spec"]["template"]["spec"], "diskd")["restartpolicy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="restartpolicy"):
        kubernetes_validate.validate(wrong, version, strict=True)
    wrong = load("daemonset.yaml")
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "300s"
    with pytest.raises(kubernetes_validate.ValidationError, match="integer"):
        kubernetes_validate.validate(wrong, version, strict=True)


def test_kustomization_names_every_resource() -> None:
    assert load("kustomization.yaml")["resources"] == RESOURCES
    assert sorted(p.name for p in HERE.glob("*.yaml")) == sorted([*RESOURCES,
                                                                   "kustomization.yaml"])


def test_the_pod_is_what_feosd_needs() -> None:
    spec = pod_spec()
    assert spec["shareProcessNamespace"] is True  # the pause process is PID 1, not feosd
    assert spec["hostNetwork"] is True
    ds = load("daemonset.yaml")
    assert ds["metadata"]["namespace"] == load("namespace.yaml")["metadata"]["name"]
    assert spec["serviceAccountName"] == load("serviceaccount.yaml")["metadata"]["name"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    for c in spec["initContainers"] + spec["containers"]:
        assert c["securityContext"] == {"privileged": True}, c["name"]
    # diskd is a sidecar: an init container that stays, started before feosd, stopped after it
    assert [(c["name"], c.get("restartPolicy")) for c in spec["initContainers"]] == [
        ("versions", None), ("diskd", "Always")]
    assert [c["name"] for c in spec["containers"]] == ["feosd"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/feos"
    assert volumes["versions"]["hostPath"]["path"] == "/usr/lib/feos"
    assert volumes["dev"]["hostPath"]["path"] == "/dev"
    mounts = {m["mountPath"]: m for m in container(spec, "feosd")["volumeMounts"]}
    assert set(mounts) == {"/var/lib/feos", "/usr/lib/feos/firecracker", "/usr/lib/feos/guest",
                           "/dev", "/run/feos"}
    # the host's versions, not over the image's /usr/lib/feos (its Python package is there)
    for kind in ("firecracker", "guest"):
        assert mounts[f"/usr/lib/feos/{kind}"]["name"] == "versions"
        assert mounts[f"/usr/lib/feos/{kind}"]["subPath"] == kind
    # diskd's FUSE exports (and ublk devices' files) made in its container reach feosd's
    assert mounts["/var/lib/feos"]["mountPropagation"] == "Bidirectional"
    disk_mounts = {m["mountPath"]: m for m in container(spec, "diskd")["volumeMounts"]}
    assert disk_mounts["/var/lib/feos"]["mountPropagation"] == "Bidirectional"


def test_feosd_suspends_on_stop_within_the_pods_grace() -> None:
    spec = pod_spec()
    command = container(spec, "feosd")["command"]
    assert command[0] == "/usr/sbin/feosd"  # exec'd directly, no wrapper holding the cgroup
    args = feosd_args(command[1:])
    assert args.suspend_on_stop
    assert args.stop_grace == spec["terminationGracePeriodSeconds"]
    assert args.state_dir == Path("/var/lib/feos") and args.run_dir == Path("/run/feos")


def test_diskd_serves_the_state_directory_until_feosd_lets_go() -> None:
    command = container(pod_spec(), "diskd")["command"]
    assert command[0] == "/usr/sbin/diskd"
    args = diskd_args(command[1:])
    assert args.state_dir == Path("/var/lib/feos/disk")
    assert args.stop_after_lock == Path("/var/lib/feos/feosd.lock")


def test_every_container_runs_the_same_image() -> None:
    spec = pod_spec()
    images = {c["image"] for c in spec["initContainers"] + spec["containers"]}
    assert images == {"feos/feosd:latest"}
    assert load("kustomization.yaml")["images"][0]["name"] == "feos/feosd"

