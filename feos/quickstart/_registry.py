"""The demo's registry: Debian's docker-registry in a network namespace of the quickstart's own.

Why not on the node's loopback: the guest pulls the image itself, through the pod's network, and
feosd's table drops every packet of a pod to the node's own addresses (`input`, and the node's
addresses are in deny4). So the registry runs in a namespace `feosqs-<tag>` (the tag a hash of
the quickstart's directory, so two directories never meet and a run finds its namespace again)
joined to the node by a veth `fqs<tag>`: the node side holds NODE_SIDE/30, the namespace side
REGISTRY/30, from 198.18.0.0/15 (RFC 2544's benchmark range, routed on no real network). The pods
reach it forwarded and masqueraded like any uplink; the node reaches it directly (skopeo's push).
Nothing else is in the namespace, so nothing of the registry reaches a real network.

The registry's data (its storage and config) is kept in `<quickstart>/registry`; its process and
the namespace live only while the quickstart runs. A run that finds the namespace and a registry
answering in it uses them (a quickstart killed with -9 leaves them).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import attrs

from feos.errors import Code, FeosError

NODE_SIDE, REGISTRY = "198.18.0.1", "198.18.0.2"
PORT = 5000
_WAIT = 20.0


@attrs.frozen
class Registry:
    data: Path
    namespace: str
    veth: str

    @property
    def host(self) -> str:
        return f"{REGISTRY}:{PORT}"

    @property
    def pid_file(self) -> Path:
        return self.data / "registry.pid"


def registry_for(quickstart_dir: Path) -> Registry:
    tag = hashlib.sha256(str(quickstart_dir.resolve()).encode()).hexdigest()[:8]
    return Registry(quickstart_dir / "registry", f"feosqs-{tag}", f"fqs{tag}")


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise FeosError(Code.FAILED_PRECONDITION, f"ip {' '.join(argv)}: {done.stderr.strip()}")
    return done


def answers(reg: Registry) -> bool:
    try:
        socket.create_connection((REGISTRY, PORT), timeout=1).close()
    except OSError:
        return False
    return True


def ensure(reg: Registry) -> bool:
    """The namespace, the veth and a registry answering in it; True if found running."""
    if answers(reg):
        return True
    if _ip("netns", "pids", reg.namespace, check=False).returncode != 0:
        _namespace(reg)
    _serve(reg)
    return False


def _namespace(reg: Registry) -> None:
    _ip("link", "del", reg.veth, check=False)  # a half-made earlier try
    _ip("netns", "add", reg.namespace)
    try:
        _ip("link", "add", reg.veth, "type", "veth", "peer", "name", "registry0",
            "netns", reg.namespace)
        _ip("addr", "add", f"{NODE_SIDE}/30", "dev", reg.veth)
        _ip("link", "set", reg.veth, "up")
        inside = ("-n", reg.namespace)
        _ip(*inside, "addr", "add", f"{REGISTRY}/30", "dev", "registry0")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", "registry0", "up")
    except BaseException:
        remove_namespace(reg)
        raise


def _serve(reg: Registry) -> None:
    reg.data.mkdir(parents=True, exist_ok=True)
    config = reg.data / "config.yml"
    config.write_text("version: 0.1\nlog: {level: error}\n"
                      f"storage: {{filesystem: {{rootdirectory: {reg.data}/storage}}}}\n"
                      f"http: {{addr: '{REGISTRY}:{PORT}'}}\n")
    with open(reg.data / "registry.log", "ab") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", reg.namespace, "docker-registry", "serve",
                                 str(config)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    reg.pid_file.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + _WAIT
    while not answers(reg):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise FeosError(Code.UNAVAILABLE, f"docker-registry did not serve on {reg.host}: "
                                              f"see {reg.data / 'registry.log'}")
        time.sleep(0.1)


def stop(reg: Registry, timeout: float = 10.0) -> None:
    """End the registry's process (its data stays) and remove the namespace with its veth."""
    for pid in _pids(reg):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pids(reg) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in _pids(reg):
        _signal(pid, signal.SIGKILL)
    reg.pid_file.unlink(missing_ok=True)
    remove_namespace(reg)


def _pids(reg: Registry) -> list[int]:
    done = _ip("netns", "pids", reg.namespace, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def remove_namespace(reg: Registry) -> None:
    _ip("netns", "del", reg.namespace, check=False)
    _ip("link", "del", reg.veth, check=False)
