"""The plain values the node's guest client takes and gives (attrs frozen): no capnp here."""

from __future__ import annotations

import attrs


@attrs.frozen
class Attached:
    version: str
    boot_id: str
    session: str


@attrs.frozen
class Ping:
    version: str
    boot_id: str
    uptime_ns: int


@attrs.frozen
class Identity:
    """A pod's identity in its guest (GuestService.assume)."""

    pod_id: str
    hostname: str
    machine_id: str
    mac: str
    entropy: bytes
    realtime_ns: int


@attrs.frozen
class NetworkConfig:
    ipv6: str = ""
    ipv4: str = ""
    resolvers: tuple[str, ...] = ()
    mtu: int = 0
    mac: str = ""


@attrs.frozen
class VolumeSpec:
    name: str
    drive: int
    size_bytes: int
    format: bool
    id: str = ""


@attrs.frozen
class VolumeOutcome:
    name: str
    mounted: bool
    error: str


@attrs.frozen
class VolumeMount:
    name: str
    path: str
    read_only: bool = False


@attrs.frozen
class ContainerConfig:
    name: str
    image: str
    command: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    volume_mounts: tuple[VolumeMount, ...] = ()
    working_dir: str = ""
    pull_token: str = attrs.field(default="", repr=False)


@attrs.frozen
class ContainerState:
    name: str
    image: str
    image_digest: str
    status: str  # created, running, stopped
    pid: int
    exit_code: int
    created_ns: int
    started_ns: int
    finished_ns: int


@attrs.frozen
class ExecResult:
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
