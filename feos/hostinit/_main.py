"""feos-host-init's start: what PID 1 does before its loop (feos/hostinit/_node.py) keeps the
node, and that loop started again should it ever fail.

Theory of operation. The synchronous start does what nothing can run without: the root off the
initramfs, the filesystems, the log on /dev/kmsg, the resolver's sockets. It imports only what
it needs and starts `modprobe` of the node's own modules before it imports the loop's modules
(pyroute2's above all take seconds under TCG), so that the two run side by side; the loop waits
for that modprobe before it starts diskd, and loads what the devices ask for beside the uplink.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

from . import _system

log = logging.getLogger("feos.hostinit")

HOSTNAME = "feos"
Setup = tuple[str, list[socket.socket]]


def main() -> None:
    if os.getpid() != 1:
        sys.exit("feos-host-init: runs as PID 1 only (the node's init)")
    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")  # the kernel gives init none
    setup: Setup | None = None
    try:
        setup, loading = _start()
    except Exception:  # PID 1 must not end: the kernel would panic; the node says why and waits
        log.exception("feos-host-init: the machine's setup failed")
        loading = None
    from . import _node  # while modprobe loads the node's modules

    while True:
        try:
            if setup is not None:
                _node.run(*setup, loading)
        except Exception:
            log.exception("feos-host-init: its loop failed; starting it again in 1 s")
        time.sleep(1.0)


def _start() -> tuple[Setup, _system.Loading | None]:
    moved = _system.move_root_off_initramfs()
    _system.mount_filesystems()
    _system.log_to_kmsg()
    log.info(
        "the root %s", "moved off the initramfs" if moved else "was a mount of its own already"
    )
    try:
        _system.reboot(_system.RB_DISABLE_CAD)  # Ctrl-Alt-Del is a SIGINT to us from now on
    except OSError as exc:  # a PID namespace's init (the sandbox) may not
        log.warning("Ctrl-Alt-Del stays the kernel's: %s", exc)
    _system.write("/proc/sys/kernel/hostname", HOSTNAME)
    try:
        dns = list(_system.bind_resolver_sockets())
    except OSError as exc:
        log.error("the pods' resolver's sockets cannot be bound: %s (feosd binds its own)", exc)
        dns = []
    log.info("cgroup2 at /sys/fs/cgroup, controllers: %s", _system.cgroup_controllers())
    try:
        loading = _system.start_modules()
    except OSError as exc:
        log.error("modules: %s", exc)
        loading = None
    return (Path("/proc/cmdline").read_text(), dns), loading
