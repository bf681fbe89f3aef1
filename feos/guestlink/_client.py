"""The node's client of a guest (node side only: feosd runs it on its Cap'n Proto asyncio thread).

`await GuestClient.connect(path)` dials QEMU's guest.sock; `await GuestClient.accept(listener)`
takes the guest's connection on Firecracker's v.sock_10001. Either reads the guest's hello (and
pokes the agent for a new session if none comes within a second), sets up the two-party RPC with
the node's NodeService exported, and gives typed async methods returning plain values. A non-ok
Status is raised as FeosError; a link that does not answer within the deadline, or breaks, as
UNAVAILABLE. One client is one session: when it ends (the agent sent a new hello, the link broke)
every call fails with UNAVAILABLE and the caller connects anew.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import capnp

from feos import _schema
from feos._sockpath import reachable
from feos.errors import Code, FeosError
from feos.guest import GUEST_HELLO, Hello, Link, Pump, node_poke
from feos.rpc import raise_for_status

from ._swaplink import SwapLink
from ._values import (
    Attached,
    ContainerConfig,
    ContainerState,
    ExecResult,
    Identity,
    NetworkConfig,
    Ping,
    VolumeOutcome,
    VolumeSpec,
)

CONNECT_DEADLINE = 5.0
POKE_AFTER = 1.0

guest: Any = _schema.guest()


def _state(s: Any) -> ContainerState:
    return ContainerState(
        name=str(s.name), image=str(s.image), image_digest=str(s.imageDigest),
        status=str(s.status), pid=int(s.pid), exit_code=int(s.exitCode),
        created_ns=int(s.createdNs), started_ns=int(s.startedNs), finished_ns=int(s.finishedNs),
    )  # fmt: skip


def _broken(e: Exception) -> FeosError:
    return FeosError(Code.UNAVAILABLE, f"the guest link broke: {e}")


async def _call(promise: Any) -> Any:
    """Awaits an RPC, raising a non-ok status as FeosError and a dropped link as UNAVAILABLE."""
    try:
        result = await promise
    except capnp.KjException as e:
        raise _broken(e) from None
    return raise_for_status(result)


class ByteReader:
    """One of the guest's ByteStreams: read() until it gives b"" (the end)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.eof = False

    async def read(self, max_bytes: int = 0) -> bytes:
        while not self.eof:
            r = await _call(self._stream.read(max_bytes))
            self.eof = bool(r.eof)
            if r.data:
                return bytes(r.data)
        return b""

    async def read_all(self) -> bytes:
        out = bytearray()
        while chunk := await self.read():
            out += chunk
        return bytes(out)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def close(self) -> None:
        await _call(self._stream.close())


class ExecProcess:
    def __init__(self, process: Any, stdout: Any, stderr: Any) -> None:
        self._process = process
        self.stdout = ByteReader(stdout)
        self.stderr = ByteReader(stderr)

    async def write_stdin(self, data: bytes) -> None:
        await _call(self._process.writeStdin(data))

    async def close_stdin(self) -> None:
        await _call(self._process.closeStdin())

    async def wait(self) -> tuple[int, int]:
        r = await _call(self._process.wait())
        return int(r.exitCode), int(r.signal)

    async def kill(self, signal: int = 15) -> None:
        await _call(self._process.kill(signal))

    async def communicate(self) -> ExecResult:
        out, err, (code, sig) = await asyncio.gather(
            self.stdout.read_all(), self.stderr.read_all(), self.wait()
        )
        return ExecResult(code, sig, out, err)


class _NodeServer(guest.NodeService.Server):  # type: ignore[misc]
    def __init__(self, on_attach: Callable[[Attached], None]) -> None:
        self.on_attach = on_attach

    async def attach_context(self, ctx: Any) -> None:
        p = ctx.params
        self.on_attach(Attached(str(p.version), str(p.bootId), str(p.session)))


async def _hello(link: Link, pump: Pump, poke_first: bool) -> Hello:
    """The agent's hello; poked for when none came within a second (or at once)."""
    if not poke_first:
        try:
            return await asyncio.wait_for(pump.next_line(GUEST_HELLO), POKE_AFTER)
        except TimeoutError:
            pass  # the agent is in a session it thinks is live (a resume, a quick reconnect)
    await link.send(node_poke(secrets.token_hex(8)))
    return await pump.next_line(GUEST_HELLO)


class GuestClient:
    """One session with a guest's agent."""

    def __init__(self, hello: Hello) -> None:
        self.boot_id, self.session = hello.fields
        self.attached: asyncio.Future[Attached] = asyncio.get_running_loop().create_future()
        self._link: Link | None = None
        self._server: Any = None
        self._stream: Any = None
        self._guest: Any = None
        self._pump: asyncio.Future[Any] | None = None
        self._theirs: socket.socket | None = None  # the pump's end of the RPC socket pair
        self.ended = asyncio.Event()

    # Connecting -----------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls, path: str, *, deadline: float = CONNECT_DEADLINE, poke_first: bool = False
    ) -> GuestClient:
        """Dials a Unix socket (QEMU's guest.sock) and starts a session within the deadline.

        With poke_first the node pokes at once rather than after a second of silence: a resumed
        agent is in a session it believes live and says hello only when poked, and a fresh one
        takes a poke before its session's first message as answered (docs/guest.md)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(deadline):
                with reachable(path) as short:
                    await asyncio.get_running_loop().sock_connect(sock, short)
                return await cls._start(SwapLink(sock), poke_first=poke_first)
        except TimeoutError:
            sock.close()
            raise FeosError(
                Code.UNAVAILABLE, f"the guest did not answer within {deadline:g}s"
            ) from None
        except OSError as e:
            sock.close()
            raise FeosError(Code.UNAVAILABLE, f"the guest link {path}: {e.strerror or e}") from None
        except BaseException:
            sock.close()
            raise

    @classmethod
    async def accept(
        cls, listener: socket.socket, *, deadline: float = CONNECT_DEADLINE
    ) -> GuestClient:
        """Takes the guest's next connection on a listening socket (v.sock_10001)."""
        listener.setblocking(False)
        sock = None
        try:
            async with asyncio.timeout(deadline):
                sock, _ = await asyncio.get_running_loop().sock_accept(listener)
                return await cls._start(SwapLink(sock))
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise FeosError(
                Code.UNAVAILABLE, f"the guest did not answer within {deadline:g}s"
            ) from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise

    @classmethod
    async def _start(cls, link: Link, *, poke_first: bool = False) -> GuestClient:
        pump = Pump(link)
        try:
            hello = await _hello(link, pump, poke_first)
        except EOFError:
            raise FeosError(Code.UNAVAILABLE, "the guest link closed before the hello") from None
        client = cls(hello)
        await client._rpc(link, pump)
        return client

    async def _rpc(self, link: Link, pump: Pump) -> None:
        ours, theirs = socket.socketpair()
        self._link = link
        try:
            self._stream = await capnp.AsyncIoStream.create_connection(sock=ours)
        except BaseException:  # cancelled or failed before the session holds them
            ours.close()
            theirs.close()
            raise
        self._server = capnp.TwoPartyServer(self._stream, bootstrap=_NodeServer(self._attached))
        self._guest = self._server.bootstrap().cast_as(guest.GuestService)
        self._theirs = theirs
        self._pump = asyncio.ensure_future(pump.session(theirs, GUEST_HELLO, first_ignored=False))
        self._pump.add_done_callback(lambda _: self._end())

    def _attached(self, a: Attached) -> None:
        if not self.attached.done():
            self.attached.set_result(a)

    def _end(self) -> None:
        if self._pump is not None and self._pump.done() and not self._pump.cancelled():
            self._pump.exception()  # EOFError of a link that closed: that is the end
        self.ended.set()

    # Across a suspend --------------------------------------------------------------------

    async def park(self, within: float) -> bool:
        """Before the VMM stops for a suspend: hold the link quiet at a message boundary (see
        SwapLink), so that this session can go on over the resumed VMM's link."""
        if not isinstance(self._link, SwapLink) or self.ended.is_set():
            return False
        return await self._link.park(within)

    async def rejoin(self, path: str) -> None:
        """Dial the resumed VMM's guest.sock and go on with this session over it."""
        if not isinstance(self._link, SwapLink) or not self._link.parked:
            raise FeosError(Code.FAILED_PRECONDITION, "the guest's session is not parked")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with reachable(path) as short:
                await asyncio.get_running_loop().sock_connect(sock, short)
        except OSError as e:
            sock.close()
            raise FeosError(Code.UNAVAILABLE, f"the guest link {path}: {e.strerror or e}") from None
        except BaseException:  # cancelled: the socket is nobody's
            sock.close()
            raise
        self._link.rebind(sock)

    async def unpark(self) -> None:
        if isinstance(self._link, SwapLink):
            self._link.unpark()

    async def close(self) -> None:
        """Ends the session and closes its sockets; also when cancelled while the pump ends,
        and when the pump never ran (a session closed as it started: the pump closes its end
        of the socket pair only once it runs)."""
        try:
            if self._pump is not None:
                self._pump.cancel()
                await asyncio.gather(self._pump, return_exceptions=True)
        finally:
            if self._server is not None:
                self._server.close()
                self._stream.close()
            if self._theirs is not None:
                self._theirs.close()
            if self._link is not None:
                self._link.close()
            self.ended.set()

    async def __aenter__(self) -> GuestClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _g(self) -> Any:
        if self.ended.is_set():
            raise FeosError(Code.UNAVAILABLE, f"the guest's session {self.session} ended")
        return self._guest

    # GuestService ---------------------------------------------------------------------------

    async def ping(self) -> Ping:
        r = await _call(self._g().ping())
        return Ping(str(r.version), str(r.bootId), int(r.uptimeNs))

    async def get_time(self) -> int:
        return int((await _call(self._g().getTime())).realtimeNs)

    async def adjust_time(self, offset_ns: int) -> bool:
        return bool((await _call(self._g().adjustTime(offset_ns))).slewed)

    async def set_time(self, realtime_ns: int) -> None:
        await _call(self._g().setTime(realtime_ns))

    async def assume(self, identity: Identity) -> None:
        i = guest.Identity.new_message(
            podId=identity.pod_id, hostname=identity.hostname, machineId=identity.machine_id,
            mac=identity.mac, entropy=identity.entropy, realtimeNs=identity.realtime_ns,
        )  # fmt: skip
        await _call(self._g().assume(i))

    async def configure_network(self, config: NetworkConfig) -> None:
        c = guest.NetworkConfig.new_message(
            ipv6=config.ipv6, ipv4=config.ipv4, resolvers=list(config.resolvers),
            mtu=config.mtu, mac=config.mac,
        )  # fmt: skip
        await _call(self._g().configureNetwork(c))

    async def mount_volumes(self, volumes: list[VolumeSpec]) -> list[VolumeOutcome]:
        msgs = [
            {
                "name": v.name,
                "id": v.id,
                "drive": v.drive,
                "sizeBytes": v.size_bytes,
                "format": v.format,
            }
            for v in volumes
        ]
        r = await _call(self._g().mountVolumes(msgs))
        return [VolumeOutcome(str(o.name), bool(o.mounted), str(o.error)) for o in r.outcomes]

    async def pull_image(self, reference: str, pull_token: str = "") -> tuple[str, bool]:
        r = await _call(self._g().pullImage(reference, pull_token))
        return str(r.digest), bool(r.joined)

    async def create_container(self, config: ContainerConfig) -> ContainerState:
        mounts = [
            {"name": m.name, "path": m.path, "readOnly": m.read_only} for m in config.volume_mounts
        ]
        msg = {
            "name": config.name, "image": config.image, "command": list(config.command),
            "env": list(config.env), "workingDir": config.working_dir,
            "pullToken": config.pull_token, "volumeMounts": mounts,
        }  # fmt: skip
        return _state((await _call(self._g().createContainer(msg))).state)

    async def start_container(self, name: str) -> ContainerState:
        return _state((await _call(self._g().startContainer(name))).state)

    async def stop_container(
        self, name: str, signal: int = 0, timeout_ms: int = 0
    ) -> ContainerState:
        return _state((await _call(self._g().stopContainer(name, signal, timeout_ms))).state)

    async def delete_container(self, name: str) -> None:
        await _call(self._g().deleteContainer(name))

    async def container_state(self, name: str) -> ContainerState:
        return _state((await _call(self._g().containerState(name))).state)

    async def list_containers(self) -> list[ContainerState]:
        return [_state(s) for s in (await _call(self._g().listContainers())).containers]

    async def logs(self, name: str, which: str = "stdout", *, follow: bool = False) -> ByteReader:
        return ByteReader((await _call(self._g().logs(name, which, follow))).stream)

    async def exec(
        self, name: str, command: list[str], env: list[str] | None = None, *, stdin: bool = False,
        tty: bool = False, working_dir: str = "", rows: int = 0, cols: int = 0,
    ) -> ExecProcess:  # fmt: skip
        """A process in the running container, in its working directory (working_dir instead)
        with its environment and env over it. tty: a terminal of rows x cols (0: 24 x 80),
        whose output is stdout (stderr has only the runtime's own errors)."""
        r = await _call(self._g().exec(name, command, env or [], stdin, tty, working_dir,
                                       rows, cols))  # fmt: skip
        return ExecProcess(r.process, r.stdout, r.stderr)

    async def freeze_filesystem(self) -> None:
        await _call(self._g().freezeFilesystem())

    async def thaw_filesystem(self) -> None:
        await _call(self._g().thawFilesystem())

    async def prepare_suspend(self, zero_free: bool = False) -> tuple[int, int]:
        r = await _call(self._g().prepareSuspend(zero_free))
        return int(r.freeBytesBefore), int(r.freeBytesAfter)

    async def shutdown(self, *, reboot: bool = False) -> None:
        await _call(self._g().shutdown(reboot))
