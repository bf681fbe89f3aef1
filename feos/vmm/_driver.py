"""The one interface both microVM drivers (QEMU, Firecracker) implement, and the values they share.

Theory of operation. The service (feos/vmm/_service.py) owns the records, the locks, the guest
link and the events; a driver owns one kind of VMM process and its directory. Every driver call
is given the whole `VmHandle` (what the record holds) and acts on that microVM alone:

    prepare  -> the directory, links to the guest's files, the config, the jail; no process
    start    -> the VMM runs and the guest boots; returns once the VMM answers its socket
    wait     -> until the VMM process ends: its `Exit` (stopped: the guest shut down or rebooted;
                crashed: anything else)
    shutdown -> Ctrl-Alt-Del / ACPI power button, wait up to the timeout, then the Exit
    suspend  -> (the guest's PrepareSuspend is the service's, before) the snapshot in snapshot/,
                the process ended, the zero pages punched out; raises busy() when late
    resume   -> the snapshot loaded, the vCPUs run, the snapshot removed
    delete   -> the process killed, what jail.json records undone, the directory removed
    adopt    -> after feosd restarted: find the process from its pid file and sockets and say
                what it is doing (running, suspended, writing a late snapshot, gone)

Drivers never touch vms.db; the service records what a call changed after it returns.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs


class VmState(enum.Enum):
    """A microVM's state as the service records it."""

    CREATED = "created"  # prepared, never started (or stopped and ready to start again)
    RUNNING = "running"
    STOPPED = "stopped"  # the guest shut down or rebooted: the VMM exited 0
    CRASHED = "crashed"  # the VMM died or failed: any other end
    SUSPENDED = "suspended"  # a snapshot in snapshot/, no process
    BUSY = "busy"  # a late snapshot: the VMM still writes it; suspends and shutdowns refused
    DELETED = "deleted"


@attrs.frozen
class VmSpec:
    """What a microVM is made with: the pod service's side of a create."""

    vcpus: int = 1
    memory_mib: int = 512
    data_disk: str | None = None  # a file (or device) the VMM opens as drive "data"
    volumes: tuple[str, ...] = ()  # drives "vol1", "vol2", ... in order
    # The disks' formats ("raw", or "qcow2": diskd's top of a layer chain, QEMU only) and the
    # layers' files the qcow2 tops stand on, which the VMM finds beside them by their names.
    data_format: str = "raw"
    volume_formats: tuple[str, ...] = ()  # by the volumes' order; "raw" where missing
    backing: tuple[str, ...] = ()
    tap: str | None = None  # the pod's TAP device, made by the network layer
    mac: str | None = None
    metadata: str = "{}"  # JSON: the pod's metadata object (MMDS under Firecracker)
    # The benchmark's floors and tests only: words appended to the kernel command line.
    kernel_extra: tuple[str, ...] = ()


@attrs.frozen
class VmHandle:
    """One microVM as a driver sees it: everything its record keeps."""

    id: str
    spec: VmSpec
    directory: Path  # the VMM's root: <state>/vms/qemu/<id>/ or <state>/vms/firecracker/<id>/root/
    guest_version: str
    guest_dir: Path  # the installed guest version's directory
    accel: str = "tcg"  # "kvm" or "tcg" (QEMU); "kvm" for Firecracker
    uid: int | None = None  # the microVM's own user, when the driver confines the VMM


@attrs.frozen
class Exit:
    """How a VMM process ended."""

    state: VmState  # STOPPED or CRASHED
    reason: str  # for people: "the guest shut down", "QEMU was killed by signal 9", ...


@attrs.frozen
class Adopted:
    """What `adopt` found of a microVM after a restart of feosd."""

    state: VmState  # RUNNING, SUSPENDED, BUSY (late snapshot), or STOPPED/CRASHED/CREATED
    reason: str = ""
    pid: int | None = None


@runtime_checkable
class Driver(Protocol):
    """A kind of VMM. Every method is async (trio); blocking work runs on worker threads."""

    name: str  # "qemu" or "firecracker": the directory under <state>/vms/ and the VmInfo's driver

    def directory(self, vm_id: str) -> Path:
        """The microVM's directory (where its sockets, logs and snapshot live)."""
        ...

    def guest_link(self, vm: VmHandle) -> Path:
        """The guest link's socket on the node's side (guest.sock, v.sock_10001)."""
        ...

    async def prepare(self, vm: VmHandle) -> None:
        """Make the directory, link the guest's files in, write the config and jail.json."""
        ...

    async def start(self, vm: VmHandle, *, within: float) -> None:
        """Start the VMM, the guest booting; return once its control socket answers."""
        ...

    async def wait(self, vm: VmHandle) -> Exit:
        """Wait until the VMM process ends (also for an adopted one) and say how."""
        ...

    async def shutdown(self, vm: VmHandle, *, grace: float) -> Exit:
        """Ask the guest to power off and wait up to `grace` seconds; then end the VMM (crashed)."""
        ...

    async def suspend(self, vm: VmHandle, *, snapshot_timeout: float) -> None:
        """Snapshot into snapshot/, end the VMM, punch the zero pages out.

        A snapshot not written within `snapshot_timeout` raises feos.errors.busy(...) and leaves
        the late-snapshot marker; the VMM is then resumed and the snapshot discarded once done
        (`late_snapshot_done`).
        """
        ...

    async def late_snapshot_done(self, vm: VmHandle) -> None:
        """Wait for a late snapshot to end, run the VM again, discard the snapshot and marker."""
        ...

    async def resume(self, vm: VmHandle, *, within: float,
                     rejoin: Callable[[], Awaitable[bool]] | None = None,
                     running: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Load the snapshot, run the vCPUs, remove the snapshot. `rejoin`, where the driver
        can, runs between the load and the vCPUs' start: the guest link's session dials the
        new VMM then (True), and the driver waits until the VMM took the connection.
        `running` is called as soon as the vCPUs run (before the snapshot is removed)."""
        ...

    async def delete(self, vm: VmHandle) -> None:
        """End the VMM, undo jail.json (links, TAPs it made), remove the directory."""
        ...

    async def adopt(self, vm: VmHandle) -> Adopted:
        """After a restart of feosd: find the VMM from its pid file and sockets, take it over."""
        ...

    def late_snapshot(self, vm: VmHandle) -> bool:
        """Whether the late-snapshot marker is in the directory."""
        ...

    def pid(self, vm: VmHandle) -> int | None:
        """The VMM's pid while it runs (the service moves it into the microVM's cgroup)."""
        ...

    def close(self) -> None:
        """Let go of every VMM without ending it: the service stops, the VMs run on."""
        ...
