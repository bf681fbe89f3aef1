"""HostService: what the node is, and its power: reboot, shutdown, and feosd's own upgrade.

What the node is includes the VMM that boots its pods (`vmm`: the VMM, the accelerator, the
reason, what --vmm asked, and the microVMs by VMM), given by the daemon as `vmm_info`."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from . import __version__
from ._codec import NoParams, takes
from .errors import Code, FeosError

log = logging.getLogger(__name__)


def in_own_pid_namespace() -> bool:
    """Whether feosd runs in a PID namespace below the host's, as in a container."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) > 2
    except OSError:
        pass
    return False


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@attrs.frozen
class UpgradeFeosBinary:
    binary: bytes = b""
    sha256: str = ""


class HostService:
    def __init__(
        self,
        *,
        state_dir: Path,
        self_upgrade: bool,
        binary: Path,
        upgrade: Callable[[Path], None],
        versions: Callable[[], dict[str, Any]],
        vmm: Callable[[], dict[str, Any]] | None = None,
        control_plane: Callable[[], dict[str, Any]] | None = None,
        mesh_device: Callable[[], str] | None = None,
    ) -> None:
        self._state_dir = state_dir
        self._self_upgrade = self_upgrade
        self._binary = binary
        self._upgrade = upgrade
        self._versions = versions
        self._vmm = vmm or (lambda: {})
        self._control_plane = control_plane or (lambda: {"configured": False})
        self._mesh_device = mesh_device or (lambda: "")
        self._started = time.time_ns()

    async def get_host_info(self, params: dict[str, Any]) -> dict[str, Any]:
        version = {"feosd": __version__, "python": platform.python_version(), **self._versions()}
        return {
            "info": {
                "hostname": socket.gethostname(),
                "kernel": platform.release(),
                "bootId": boot_id(),
                "pid": os.getpid(),
                "startedUnixNs": self._started,
                "version": version,
                "selfUpgrade": self._self_upgrade,
                "vmm": self._vmm(),
                "meshDevice": self._mesh_device(),
            }
        }

    @takes(NoParams)
    async def get_control_plane(self, call: NoParams) -> dict[str, Any]:
        """The control-plane link as feos.fleet's Link.info() says it (docs/control-plane.md)."""
        return {"info": self._control_plane()}

    def _signal_init(self, signum: int, what: str) -> None:
        if in_own_pid_namespace():
            raise FeosError(
                Code.FAILED_PRECONDITION,
                f"feosd runs in a PID namespace of its own: it cannot {what} the node",
            )
        log.warning("asked to %s the node: signalling PID 1", what)
        os.kill(1, signum)

    @takes(NoParams)
    async def reboot(self, call: NoParams) -> dict[str, Any]:
        self._signal_init(signal.SIGRTMIN + 5, "reboot")
        return {}

    @takes(NoParams)
    async def shutdown(self, call: NoParams) -> dict[str, Any]:
        self._signal_init(signal.SIGRTMIN + 4, "shut down")
        return {}

    @takes(UpgradeFeosBinary)
    async def upgrade_feos_binary(self, call: UpgradeFeosBinary) -> dict[str, Any]:
        if not self._self_upgrade:
            raise FeosError(Code.FAILED_PRECONDITION, "feosd runs without --self-upgrade")
        binary, expected = call.binary, call.sha256.lower()
        if not binary:
            raise FeosError(Code.INVALID_ARGUMENT, "binary: is empty")
        if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
            raise FeosError(Code.INVALID_ARGUMENT, "sha256: must be 64 hex digits")
        actual = hashlib.sha256(binary).hexdigest()
        if actual != expected:
            raise FeosError(
                Code.INVALID_ARGUMENT, f"sha256: the binary's is {actual}, not {expected}"
            )
        staged = await trio.to_thread.run_sync(self._stage, binary)
        # The daemon answers first and execs the new program a moment later.
        self._upgrade(staged)
        return {}

    def _stage(self, binary: bytes) -> Path:
        """The new program beside the old one, so that the move over it is one rename.

        A copy is kept in <state-dir>/upgrade/ too, for the operator to see what was asked.
        """
        from .records import write_whole

        directory = self._state_dir / "upgrade"
        directory.mkdir(parents=True, exist_ok=True)
        write_whole(directory / "feosd", binary)
        staged = self._binary.with_name(f".{self._binary.name}.upgrade")
        try:
            write_whole(staged, binary)
        except OSError as exc:
            why = f"the new program cannot be written beside {self._binary}: {exc}"
            raise FeosError(Code.FAILED_PRECONDITION, why) from exc
        os.chmod(staged, 0o755)
        return staged


def replace_binary(staged: Path, binary: Path) -> None:
    """Move the staged program over feosd's own, atomically."""
    os.replace(staged, binary)
    from .records import fsync_dir

    fsync_dir(binary.parent)


def own_binary() -> Path:
    return Path(sys.argv[0]).resolve()


def vmm_info(choice: Any, drivers: list[str], probing: str = "") -> dict[str, Any]:
    """HostInfo.vmm from the microVM service's choice (a VmmChoice, None before it decided: then
    `probing` says what the probe is doing, MicroVms.probing) and the drivers of the microVMs it
    serves."""
    counts = {name: drivers.count(name) for name in sorted(set(drivers))}
    microvms = [{"driver": d, "count": n} for d, n in counts.items()]
    if choice is None:
        return {"reason": probing or "not decided yet", "microvms": microvms}
    return {"driver": choice.driver, "accel": choice.accel, "reason": choice.reason,
            "requested": choice.requested, "microvms": microvms}
