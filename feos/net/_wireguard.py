"""The mesh's WireGuard device behind one interface: the kernel's (generic netlink) or wireguard-go.

Theory of operation. `WgDevice` is what the mesh asks of a device: `ensure(private key, port)`
makes it (or finds it) and sets what differs, `apply(changes)` removes and sets peers, `read()`
says what the device has. Two backends do it:

- `GenlDevice` (feos.net._wireguard_genl): a link of kind wireguard made over rtnetlink,
  configured with WG_CMD_SET_DEVICE messages of WireGuard's generic netlink family, as wg(8)
  does, without running it.
- `UapiDevice`: where the kernel has no WireGuard, wireguard-go (Debian's package) is the device;
  the same configuration goes over its UAPI socket as text (`uapi_set`). wireguard-go is a
  process of its own, in a session of its own: it outlives feosd and the next feosd adopts it by
  its pid file and its socket, so the sessions stay. It runs in a mount namespace of its own
  whose /run/wireguard is <run dir>/mesh, so that two of them on one machine (two nodes in
  network namespaces, the tests) do not take each other's socket.

Both configure peers by their public key alone: a set peer gets its endpoint and its one allowed
prefix (replace_allowed_ips), a removed one goes; the others are not touched and keep their
sessions. Everything here blocks: the mesh calls it on worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any, Protocol

import attrs

from feos.errors import Code, FeosError

from ._mesh_model import PeerChanges

log = logging.getLogger(__name__)

DEVICE = "feos-mesh"
MTU = 1420
UAPI_TIMEOUT_S = 5.0
START_WITHIN_S = 5.0


@attrs.frozen
class DevicePeer:
    """A peer as the device reports it."""

    public_key: bytes
    endpoint: str
    allowed: tuple[str, ...]
    last_handshake_s: int
    rx_bytes: int
    tx_bytes: int


@attrs.frozen
class DeviceState:
    public_key: bytes
    port: int
    peers: tuple[DevicePeer, ...]


class WgDevice(Protocol):
    kind: str

    def ensure(self, private_key: bytes, port: int) -> None: ...
    def apply(self, changes: PeerChanges) -> None: ...
    def read(self) -> DeviceState: ...
    def close(self) -> None: ...


# --- UAPI (wireguard-go): the text protocol -----------------------------------------------------


def uapi_set(changes: PeerChanges, *, private_key: bytes | None = None,
             port: int | None = None) -> str:
    """A `set=1` request: the device's key and port if given, then each peer removed or set."""
    lines = ["set=1"]
    if private_key is not None:
        lines.append(f"private_key={private_key.hex()}")
    if port is not None:
        lines.append(f"listen_port={port}")
    for key in changes.remove:
        lines += [f"public_key={key.hex()}", "remove=true"]
    for peer in changes.set:
        lines += [f"public_key={peer.public_key.hex()}", f"endpoint={peer.endpoint_text()}",
                  "replace_allowed_ips=true", f"allowed_ip={peer.prefix_text()}"]
    return "\n".join(lines) + "\n\n"


def parse_uapi_get(text: str) -> DeviceState:
    """The answer to `get=1`: the device's lines, then a group per peer from its public_key."""
    device: dict[str, str] = {}
    peers: list[dict[str, Any]] = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "public_key":
            peers.append({"public_key": value, "allowed_ip": []})
        elif key == "allowed_ip" and peers:
            peers[-1]["allowed_ip"].append(value)
        elif peers:
            peers[-1][key] = value
        else:
            device[key] = value
    if device.get("errno", "0") != "0" or (peers and peers[-1].get("errno", "0") != "0"):
        raise FeosError(Code.INTERNAL, f"wireguard-go's get failed: {text.strip()!r}")
    private = bytes.fromhex(device.get("private_key", ""))
    return DeviceState(_public_of(private) if private else b"", int(device.get("listen_port", 0)),
                       tuple(_device_peer(p) for p in peers))


def _device_peer(p: dict[str, Any]) -> DevicePeer:
    return DevicePeer(bytes.fromhex(p["public_key"]), p.get("endpoint", ""),
                      tuple(p["allowed_ip"]), int(p.get("last_handshake_time_sec", 0)),
                      int(p.get("rx_bytes", 0)), int(p.get("tx_bytes", 0)))


def _public_of(private: bytes) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    key = x25519.X25519PrivateKey.from_private_bytes(private).public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class UapiDevice:
    """wireguard-go as feos-mesh, configured over its UAPI socket; adopted after a restart."""

    kind = "wireguard-go (userspace, UAPI socket)"

    def __init__(self, run_dir: Path, netns: str | None = None) -> None:
        self.dir = Path(run_dir)
        self.netns = netns
        self.socket_path = self.dir / f"{DEVICE}.sock"
        self.pid_path = self.dir / "wireguard-go.pid"
        self.pid: int | None = None

    def ensure(self, private_key: bytes, port: int) -> None:
        if not self._adopt():
            self._start()
        state = self.read()
        if state.public_key != _public_of(private_key) or state.port != port:
            # an equal key keeps wireguard-go's sessions; only what differs is sent
            self._request(uapi_set(PeerChanges(),
                                   private_key=None if state.public_key == _public_of(private_key)
                                   else private_key,
                                   port=None if state.port == port else port))

    def apply(self, changes: PeerChanges) -> None:
        if changes:
            self._request(uapi_set(changes))

    def read(self) -> DeviceState:
        return parse_uapi_get(self._exchange("get=1\n\n"))

    def close(self) -> None:
        """Let go of wireguard-go: it runs on for the next feosd."""
        self.pid = None

    def stop(self) -> None:
        """End wireguard-go (the tests' cleanup; feosd never does: the mesh outlives it)."""
        pid = self.pid or _read_pid(self.pid_path)
        if pid is not None and _is_wireguard_go(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            _wait_gone(pid, 5.0)
        self.pid = None

    def _adopt(self) -> bool:
        pid = _read_pid(self.pid_path)
        if pid is None or not _is_wireguard_go(pid):
            return False
        try:
            self._exchange("get=1\n\n")
        except FeosError as e:
            log.warning("wireguard-go %d does not answer (%s): started anew", pid, e.message)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)
            return False
        self.pid = pid
        log.info("the mesh: wireguard-go %d adopted", pid)
        return True

    def _start(self) -> None:
        binary = shutil.which("wireguard-go")
        if binary is None:
            raise FeosError(Code.FAILED_PRECONDITION,
                            "the kernel has no WireGuard and wireguard-go is not installed")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self.pid = _spawn_wireguard_go(binary, self.dir, self.netns)
        self.pid_path.write_text(f"{self.pid}\n")
        deadline = time.monotonic() + START_WITHIN_S
        while not self.socket_path.exists():
            if time.monotonic() > deadline or not _alive(self.pid):
                self.stop()
                tail = _tail(self.dir / "wireguard-go.log")
                raise FeosError(Code.UNAVAILABLE, f"wireguard-go did not start: {tail}")
            time.sleep(0.02)
        log.info("the mesh: wireguard-go %d started", self.pid)

    def _request(self, text: str) -> None:
        answer = self._exchange(text)
        if answer.strip() != "errno=0":
            raise FeosError(Code.INTERNAL, f"wireguard-go refused the change: {answer.strip()!r}")

    def _exchange(self, text: str) -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(UAPI_TIMEOUT_S)
                sock.connect(str(self.socket_path))
                sock.sendall(text.encode())
                got = b""
                while not got.endswith(b"\n\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    got += chunk
        except OSError as e:
            raise FeosError(Code.UNAVAILABLE, f"wireguard-go's socket {self.socket_path}: {e}"
                            ) from None
        return got.decode()


def _spawn_wireguard_go(binary: str, run_dir: Path, netns: str | None) -> int:
    """wireguard-go -f in a session and a mount namespace of its own (see the module's doc)."""
    script = ('mkdir -p /run/wireguard && mount --bind "$1" /run/wireguard && exec "$2" -f '
              f"{DEVICE}")
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(run_dir), binary]
    if netns is not None:
        argv = ["nsenter", f"--net=/run/netns/{netns}", *argv]
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LOG_LEVEL": "error",
           "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}
    log_fd = os.open(run_dir / "wireguard-go.log",
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, log_fd, 1),
                   (os.POSIX_SPAWN_DUP2, log_fd, 2)]
        path = shutil.which(argv[0]) or argv[0]
        return os.posix_spawn(path, argv, env, file_actions=actions, setsid=True)
    finally:
        os.close(log_fd)
        os.close(null)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # feosd's own child, ended (and reaped here)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _is_wireguard_go(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z" and any(a.endswith(b"wireguard-go") for a in cmdline[:1]) and \
        DEVICE.encode() in cmdline


def _wait_gone(pid: int, within: float) -> None:
    """Until the process is gone (or a zombie of another's); a child of ours is reaped."""
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _tail(path: Path) -> str:
    try:
        return path.read_text()[-400:].strip() or "(nothing logged)"
    except OSError:
        return "(no log)"


def kernel_has_wireguard() -> bool:
    return Path("/sys/module/wireguard").exists()


def choose_device(run_dir: Path, netns: str | None = None) -> WgDevice:
    """The kernel's WireGuard where it has one, else wireguard-go."""
    if kernel_has_wireguard():
        from ._wireguard_genl import GenlDevice

        return GenlDevice(netns)
    return UapiDevice(run_dir, netns)
