"""PodSpec: what a pod is made of, checked at the API's edge and normalised for comparison.

A spec arrives as the dict of a Cap'n Proto PodSpec. `parse_spec` checks every field, naming it
in its error (`spec.containers[0].image: ...`), fills the defaults (1 vCPU, 512 MiB), and returns
a `PodSpec` whose `to_dict()` is what the record keeps and what a second CreatePod with the same
ID is compared with.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from ..errors import invalid
from ..net import PublishedPort, check_publish, is_label, validate_metadata, validate_pod_groups

CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
LETTERS = "abcdefghjkmnpqrstvwxyz"
_SHORT_ID = re.compile(r"[a-hjkmnp-tv-z][0-9a-hjkmnp-tv-z]{10}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_VOLUME_NAME = re.compile(r"[a-z0-9-]{1,63}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# [registry/]repository[:tag][@sha256:digest], as `docker pull` takes it: the first component is
# a registry only when it has a dot or a port, or is localhost
_REGISTRY = re.compile(r"(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)+|localhost|\[[0-9a-fA-F:]+\])"
                       r"(?::[0-9]+)?|[a-zA-Z0-9-]+:[0-9]+")
_REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                         r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
                         r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")


def is_image_reference(text: str) -> bool:
    first, sep, rest = text.partition("/")
    if sep and _REGISTRY.fullmatch(first):
        return _REPOSITORY.fullmatch(rest) is not None
    return _REPOSITORY.fullmatch(text) is not None

MAX_VCPUS = 32
MIN_MEMORY, MAX_MEMORY = 128, 262144
MAX_VOLUMES = 8
MAX_CONTAINERS = 32
MAX_UPSTREAMS = 8
MAX_PUBLISH = 64


def new_pod_id() -> str:
    """A pod ID as feosctl mints it: 11 of lowercase Crockford base32, a letter first."""
    return secrets.choice(LETTERS) + "".join(secrets.choice(CROCKFORD) for _ in range(10))


def check_pod_id(value: object, field: str = "id") -> str:
    if isinstance(value, str) and (_SHORT_ID.fullmatch(value) or _UUID.fullmatch(value)):
        return value
    raise invalid(field, "must be 11 of lowercase Crockford base32 with a letter first "
                         "(such as k3mz8q0v2xa), or a lowercase UUID")


def is_uuid(pod_id: str) -> bool:
    return _UUID.fullmatch(pod_id) is not None


@attrs.frozen
class Mount:
    volume: str
    path: str
    read_only: bool = False


@attrs.frozen
class Container:
    name: str
    image: str
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    working_dir: str = ""


@attrs.frozen
class Network:
    security_groups: tuple[str, ...] = ()
    name_tables: tuple[str, ...] = ()
    dns_upstreams: tuple[str, ...] = ()
    publish: tuple[PublishedPort, ...] = ()


@attrs.frozen
class PodSpec:
    vcpus: int
    memory_mib: int
    containers: tuple[Container, ...]
    network: Network | None  # None: no network
    volumes: tuple[tuple[str, str], ...]  # (name, volume ID)
    metadata_json: str
    disk_size_mib: int = 0

    def volume_ids(self) -> list[str]:
        return [volume_id for _, volume_id in self.volumes]

    def to_dict(self) -> dict[str, Any]:
        network: dict[str, Any]
        if self.network is None:
            network = {"none": None}
        else:
            network = {"pod": {"securityGroups": list(self.network.security_groups),
                               "nameTables": list(self.network.name_tables),
                               "dnsUpstreams": list(self.network.dns_upstreams),
                               "publish": [_publish_dict(p) for p in self.network.publish]}}
        return {
            "vcpus": self.vcpus,
            "memoryMib": self.memory_mib,
            "containers": [
                {"name": c.name, "image": c.image, "command": list(c.command),
                 "env": [{"key": k, "value": v} for k, v in c.env],
                 "volumeMounts": [{"volume": m.volume, "path": m.path, "readOnly": m.read_only}
                                  for m in c.mounts],
                 "workingDir": c.working_dir}
                for c in self.containers
            ],
            "network": network,
            "volumes": [{"name": n, "volumeId": v} for n, v in self.volumes],
            "metadataJson": self.metadata_json,
            "diskSizeMib": self.disk_size_mib,
        }


def _publish_dict(p: PublishedPort) -> dict[str, Any]:
    return {"protocol": p.protocol, "hostAddress": p.host_address, "hostPort": p.host_port,
            "podPort": p.pod_port}


def _vcpus(value: Any) -> int:
    vcpus = value or 1
    if not isinstance(vcpus, int) or not 1 <= vcpus <= MAX_VCPUS:
        raise invalid("spec.vcpus", f"must be 1 to {MAX_VCPUS}")
    return vcpus


def _memory(value: Any) -> int:
    memory = value or 512
    if not isinstance(memory, int) or not MIN_MEMORY <= memory <= MAX_MEMORY or memory % 2:
        raise invalid("spec.memoryMib", f"must be an even number from {MIN_MEMORY} to {MAX_MEMORY}")
    return memory


def _volumes(items: Sequence[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    if len(items) > MAX_VOLUMES:
        raise invalid("spec.volumes", f"at most {MAX_VOLUMES}")
    volumes: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        name, volume_id = item.get("name", ""), item.get("volumeId", "")
        if not _VOLUME_NAME.fullmatch(name):
            raise invalid(f"spec.volumes[{i}].name",
                          "must be 1 to 63 of lowercase letters, digits and -")
        if not _UUID.fullmatch(volume_id):
            raise invalid(f"spec.volumes[{i}].volumeId", "must be a volume's ID, a lowercase UUID")
        if any(name == n for n, _ in volumes):
            raise invalid(f"spec.volumes[{i}].name", f"{name} is given twice")
        if any(volume_id == v for _, v in volumes):
            raise invalid(f"spec.volumes[{i}].volumeId", f"volume {volume_id} is given twice")
        volumes.append((name, volume_id))
    return tuple(volumes)


def _mounts(items: Sequence[dict[str, Any]], where: str, names: set[str]) -> tuple[Mount, ...]:
    mounts = []
    for i, item in enumerate(items):
        field = f"{where}.volumeMounts[{i}]"
        volume, path = item.get("volume", ""), item.get("path", "")
        if volume not in names:
            raise invalid(f"{field}.volume", f"{volume!r} is not a name of spec.volumes")
        if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            raise invalid(f"{field}.path", "must be an absolute path without ..")
        mounts.append(Mount(volume, path.rstrip("/") or "/", bool(item.get("readOnly", False))))
    return tuple(mounts)


def _container(item: dict[str, Any], i: int, names: set[str]) -> Container:
    where = f"spec.containers[{i}]"
    name, image = item.get("name", ""), item.get("image", "")
    if not is_label(name):
        raise invalid(f"{where}.name", "must be one lowercase DNS label (a-z, 0-9, -; 1 to 63)")
    if not image or len(image) > 512 or not is_image_reference(image):
        raise invalid(f"{where}.image", "must be an OCI reference such as "
                                        "registry.example:5000/app:1.0")
    env = []
    for j, pair in enumerate(item.get("env", [])):
        key = pair.get("key", "")
        if not _ENV_KEY.fullmatch(key):
            raise invalid(f"{where}.env[{j}].key",
                          "must be a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        env.append((key, pair.get("value", "")))
    command = tuple(item.get("command", []))
    if any("\0" in arg for arg in command):
        raise invalid(f"{where}.command", "must not hold NUL bytes")
    working_dir = item.get("workingDir", "")
    if working_dir and not working_dir.startswith("/"):
        raise invalid(f"{where}.workingDir", "must be an absolute path")
    return Container(name, image, command, tuple(env),
                     _mounts(item.get("volumeMounts", []), where, names), working_dir)


def _network(data: dict[str, Any]) -> Network | None:
    if "none" in data:
        return None
    pod = data.get("pod", {})
    groups = tuple(pod.get("securityGroups", []))
    validate_pod_groups(list(groups), "spec.network.securityGroups")
    tables = tuple(pod.get("nameTables", []))
    for i, table in enumerate(tables):
        if not is_label(table):
            raise invalid(f"spec.network.nameTables[{i}]", "must be a name table's ID")
        if table in tables[:i]:
            raise invalid(f"spec.network.nameTables[{i}]", f"{table} is named twice")
    upstreams = tuple(pod.get("dnsUpstreams", []))
    if len(upstreams) > MAX_UPSTREAMS:
        raise invalid("spec.network.dnsUpstreams", f"at most {MAX_UPSTREAMS}")
    return Network(groups, tables, upstreams, _publish(pod.get("publish", [])))


def _publish(items: Sequence[dict[str, Any]]) -> tuple[PublishedPort, ...]:
    """spec.network.publish: ports 1 to 65535, tcp or udp (empty: tcp), an address that parses
    (written canonically; empty: every address of the node), no two that overlap."""
    if len(items) > MAX_PUBLISH:
        raise invalid("spec.network.publish", f"at most {MAX_PUBLISH}")
    ports = []
    for i, item in enumerate(items):
        address = item.get("hostAddress", "") or ""
        if not isinstance(address, str):
            raise invalid(f"spec.network.publish[{i}].hostAddress", "must be an address's text")
        try:
            address = str(ipaddress.ip_address(address)) if address else ""
        except ValueError:
            pass  # check_publish names it
        ports.append(PublishedPort(item.get("protocol", "") or "tcp", address,
                                   item.get("hostPort", 0), item.get("podPort", 0)))
    check_publish(ports, "spec.network.publish")
    return tuple(ports)


def _metadata(text: str) -> str:
    if not text:
        return "{}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid("spec.metadataJson", f"must be a JSON object ({exc})") from None
    validate_metadata(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def parse_spec(data: dict[str, Any]) -> PodSpec:
    """A checked, normalised spec from a PodSpec's dict; INVALID_ARGUMENT naming the field."""
    try:
        return _parse_spec(data)
    except (AttributeError, TypeError, KeyError) as exc:
        # The wire's types are the schema's; a spec from a file or a record may be anything.
        raise invalid("spec", f"is not a PodSpec ({exc})") from None


def _parse_spec(data: dict[str, Any]) -> PodSpec:
    volumes = _volumes(data.get("volumes", []))
    names = {name for name, _ in volumes}
    items = data.get("containers", [])
    if len(items) > MAX_CONTAINERS:
        raise invalid("spec.containers", f"at most {MAX_CONTAINERS}")
    containers = tuple(_container(item, i, names) for i, item in enumerate(items))
    seen: set[str] = set()
    for i, container in enumerate(containers):
        if container.name in seen:
            raise invalid(f"spec.containers[{i}].name", f"{container.name} is given twice")
        seen.add(container.name)
    disk = data.get("diskSizeMib", 0)
    if disk and not 1024 <= disk <= 16 << 20:
        raise invalid("spec.diskSizeMib",
                      "must be 0 (the guest's default) or 1024 to 16 TiB in MiB")
    return PodSpec(
        vcpus=_vcpus(data.get("vcpus", 0)),
        memory_mib=_memory(data.get("memoryMib", 0)),
        containers=containers,
        network=_network(data.get("network", {"pod": {}})),
        volumes=volumes,
        metadata_json=_metadata(data.get("metadataJson", "")),
        disk_size_mib=disk,
    )


def spec_from_record(data: dict[str, Any]) -> PodSpec:
    """A kept spec: checked as at create, so a record from an older feosd is refused alike."""
    return parse_spec(data)


__all__ = ["PodSpec", "check_pod_id", "new_pod_id", "parse_spec", "uuid"]
