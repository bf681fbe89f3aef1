"""The agent: finds the link, runs one session after another on it, and keeps the guest's state.

A session: the hello (docs/guest.md), then a two-party RPC system whose bootstrap is GuestService
and whose peer's bootstrap is the node's NodeService, which the agent calls attach on. It ends
when the link reads EOF (the node went: a new session waits for it), when the node pokes, or when
the RPC system drops the connection; the agent then starts the next with a new hello.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable

from feos.errors import Code, FeosError

from . import _identity, _initramfs, _proc, _system
from ._containers import Containers
from ._hello import NODE_POKE, guest_hello
from ._images import ImageStore
from ._link import DeviceLink, Link, Pump
from ._proto import guest
from ._rpc import Connection
from ._service import GuestServer, log

TYPE_CHECKING = False  # typing costs the guest's start: for mypy only
if TYPE_CHECKING:
    from typing import Any

AGENT_VERSION = "1"
VSOCK_HOST_CID = 2
VSOCK_PORT = 10001
INITRAMFS_DELAY = 5.0  # after the first attach: the pod's bring-up comes first


class Options:
    def __init__(self) -> None:
        self.link = ""  # "", a virtio port name, "vsock", "unix:PATH", "fd:N"
        self.data_dir = "/data"
        self.volumes_dir = "/volumes"
        self.run_dir = "/run/feos-guest"
        self.crun_root = "/run/crun"
        self.crun_cgroups = ""  # crun's --cgroup-manager: "" its own (cgroupfs), or "disabled"
        self.resolv_conf = "/run/resolv.conf"  # the image's /etc/resolv.conf points there
        self.drives: dict[int, str] = {}
        self.sys_block = "/sys/block"  # tests point these at directories of their own
        self.sys_net = "/sys/class/net"
        self.pid1 = os.getpid() == 1


def kernel_link() -> str:
    try:
        with open("/proc/cmdline") as f:
            words = f.read().split()
    except OSError:
        words = []
    for w in words:
        if w.startswith("feos.link="):
            return w.partition("=")[2]
    return "feos.guest"


def _version() -> str:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        with open(os.path.join(here, "VERSION")) as f:
            return f"{AGENT_VERSION}+{f.read().strip()}"
    except OSError:
        return AGENT_VERSION


class Agent:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.version = _version()
        self.boot_id = _system.boot_id()
        self.started_ns = time.monotonic_ns()
        self.reaper = _proc.Reaper(all_orphans=opts.pid1)
        self.images = ImageStore(opts.data_dir)
        self.resolv_conf = opts.resolv_conf
        self.containers = Containers(opts.data_dir, opts.volumes_dir, self.resolv_conf,
                                     opts.crun_root, opts.crun_cgroups, self.images,
                                     self.reaper)  # fmt: skip
        self.initramfs = _initramfs.take()  # /init's, once the first session is up
        self.done = asyncio.Event()
        self.reboot = False
        self._shutdown: asyncio.Future[None] | None = None

    # The session loop --------------------------------------------------------------------

    async def run(self) -> None:
        self.reaper.install()
        os.makedirs(self.opts.run_dir, exist_ok=True)
        if not os.path.exists(self.resolv_conf):  # noqa: ASYNC240 (a tmpfs)
            _system.write_in_place(self.resolv_conf, "")
        await self.containers.load()
        serving = asyncio.ensure_future(self.serve(self.connector()))
        await self.done.wait()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        self.reaper.uninstall()

    def connector(self) -> Callable[[], Awaitable[Link]]:
        link = self.opts.link or kernel_link()
        if link.startswith("fd:"):
            sock = socket.socket(fileno=int(link[3:]))
            used = False

            async def once() -> Link:
                nonlocal used
                if used:
                    await self.done.wait()
                used = True
                return Link(sock)

            return once
        if link.startswith("unix:") or link == "vsock":
            return lambda: _connect_socket(link)
        return lambda: _open_port(link)

    async def serve(self, connect: Callable[[], Awaitable[Link]]) -> None:
        while True:
            try:
                link = await connect()
            except OSError as e:
                log(f"the link is not there yet: {e}")
                await asyncio.sleep(0.5)
                continue
            try:
                await self._sessions(link)
            except (EOFError, OSError) as e:
                log(f"the link broke: {e}")
            link.close()  # a port opens once at a time: it is opened anew

    async def _sessions(self, link: Link) -> None:
        pump = Pump(link)
        while True:
            await link.wait_peer()
            session = os.urandom(8).hex()  # not secrets: it imports hashlib (boot time)
            await link.send(guest_hello(self.boot_id, session))
            log(f"session {session}: hello sent (at {time.monotonic():.3f} s)")
            ended = await self._session(pump, session)
            log(f"session {session} ended: {'the node poked' if ended else 'RPC closed'}")

    async def _session(self, pump: Pump, session: str) -> object:
        ours, theirs = socket.socketpair()
        conn = Connection(ours, GuestServer(self))
        reading = asyncio.ensure_future(conn.run())
        reading.add_done_callback(lambda _: ours.close())  # the pump then ends the session
        node = conn.bootstrap().cast_as(guest.NodeService)
        attach = asyncio.ensure_future(self._attach(node, session))
        try:
            return await pump.session(theirs, NODE_POKE, first_ignored=True)
        finally:
            for task in (attach, reading):
                task.cancel()
            await asyncio.gather(attach, reading, return_exceptions=True)
            conn.close()
            ours.close()

    async def _attach(self, node: Any, session: str) -> None:
        try:
            await node.attach(self.version, self.boot_id, session)
        except Exception as e:
            log(f"session {session}: attach failed: {e}")
            return
        if self.initramfs is not None:  # the node is there: the boot is done
            fd, self.initramfs = self.initramfs, None
            asyncio.get_running_loop().call_later(INITRAMFS_DELAY, _initramfs.release, fd, log)

    # What GuestServer asks for -------------------------------------------------------------

    async def configure_network(self, cfg: dict[str, Any]) -> None:
        dev = _system.find_device(cfg["mac"], self.opts.sys_net)
        # rtnetlink on this thread: each request is answered inside its send (microseconds)
        _system.configure_network(dev, cfg["ipv6"], cfg["ula"], cfg["ipv4"], cfg["mtu"])
        _system.write_in_place(self.resolv_conf, _system.resolv_conf(cfg["resolvers"]))

    async def assume(self, hostname: str, machine_id: str, mac: str, entropy: bytes,
                     realtime_ns: int) -> None:
        """The pod's identity (feos.guest._identity): the pool reseeded first, so that nothing
        the agent answers after it comes of the template's."""
        _identity.reseed(entropy)
        _identity.set_hostname(hostname)
        path = _identity.write_machine_id(self.opts.run_dir, machine_id)
        _identity.set_mac(mac, self.opts.sys_net)
        if realtime_ns > 0:
            _system.set_time(realtime_ns)
        self.containers.identity(hostname, path)

    async def mount_volumes(self, vols: list[dict[str, Any]]) -> list[tuple[str, str]]:
        where = await _system.writable_dir(self.reaper, self.opts.volumes_dir, self.opts.run_dir)
        self.opts.volumes_dir = self.containers.volumes_dir = where
        outcomes = []
        for vol in vols:
            try:
                device = self.opts.drives.get(vol["drive"]) or _system.drive_path(
                    vol["drive"], self.opts.sys_block
                )
                await _system.mount_volume(self.reaper, self.opts.volumes_dir, vol, device)
                outcomes.append((vol["name"], ""))
            except FeosError as e:
                outcomes.append((vol["name"], e.message))
            except OSError as e:
                outcomes.append((vol["name"], f"{type(e).__name__}: {e}"))
        return outcomes

    async def freeze(self, *, thaw: bool) -> None:
        loop = asyncio.get_running_loop()
        if not thaw:
            self.containers.saves.frozen = True
        try:
            await loop.run_in_executor(None, _system.freeze, self.opts.data_dir, thaw)
        except FeosError:
            if not thaw:
                self.containers.saves.thawed()
            raise
        if thaw:
            self.containers.saves.thawed()

    def request_shutdown(self, reboot: bool) -> None:
        if self._shutdown is not None:
            raise FeosError(Code.FAILED_PRECONDITION, "the guest is shutting down already")
        self.reboot = reboot
        self._shutdown = asyncio.ensure_future(self._shut_down())

    async def _shut_down(self) -> None:
        await asyncio.sleep(0.2)  # the answer goes out first
        log("shutting down: stopping the containers")
        await self.containers.stop_all(10.0)
        if self.containers.saves.frozen:
            await self.freeze(thaw=True)
        for name in (
            sorted(os.listdir(self.opts.volumes_dir))
            if os.path.isdir(self.opts.volumes_dir)  # noqa: ASYNC240
            else []
        ):
            target = os.path.join(self.opts.volumes_dir, name)
            if _system.mounted_source(target):
                await _proc.run(self.reaper, ["umount", target])
        os.sync()
        self.done.set()


async def _connect_socket(link: str) -> Link:
    if link == "vsock":
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        address: Any = (VSOCK_HOST_CID, VSOCK_PORT)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = link[len("unix:") :]
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, address)
    except OSError:
        sock.close()
        raise
    return Link(sock)


async def _open_port(name: str) -> Link:
    """The virtio-serial port named name: /dev/<vportNpM> by /sys/class/virtio-ports/*/name."""
    base = "/sys/class/virtio-ports"
    try:
        ports = sorted(os.listdir(base))
    except OSError:
        ports = []
    for port in ports:
        try:
            with open(os.path.join(base, port, "name")) as f:  # noqa: ASYNC230 (sysfs)
                if f.read().strip() != name:
                    continue
        except OSError:
            continue
        return DeviceLink(os.open(f"/dev/{port}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC))
    raise FileNotFoundError(f"no virtio port named {name}")
