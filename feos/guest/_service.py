"""GuestService, on the guest's own Cap'n Proto (_rpc): each method reads its request into plain
values, checks them, acts, and answers with a Status. Nothing a method raises ends the agent:
every method is guarded, a FeosError becomes its status and anything else INTERNAL, logged on
the console with its trace.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable

from feos.errors import Code, FeosError, invalid

from . import _containers, _system, _validate
from ._proto import fill_status, guest
from ._streams import FileStream, PipeStream, ProcessServer
from ._token import PullToken
from ._wire import WireError

TYPE_CHECKING = False  # typing costs the guest's start: for mypy only
if TYPE_CHECKING:
    from typing import Any

LOG_STREAMS = {"stdout": "stdout", "stderr": "stderr"}


def log(message: str) -> None:
    print(f"feos-guest: {message}", flush=True)


SLOW_CALL_S = 0.05  # a call that took longer is named on the console, with its time


async def guarded(name: str, context: Any, body: Callable[[Any, Any], Awaitable[None]]) -> None:
    started = time.monotonic()
    try:
        await body(context.params, context.results)
        took = time.monotonic() - started
        if took >= SLOW_CALL_S:
            log(f"{name} took {took:.3f} s (done at {time.monotonic():.3f} s)")
    except FeosError as e:
        fill_status(context.results.status, e)
    except UnicodeDecodeError as e:
        fill_status(context.results.status, invalid(name, f"text that is not UTF-8 ({e.reason})"))
    except WireError as e:
        fill_status(context.results.status, invalid(name, f"a request that does not decode: {e}"))
    except Exception as e:
        log(f"{name} failed: {''.join(traceback.format_exception(e)).rstrip()}")
        fill_status(
            context.results.status, FeosError(Code.INTERNAL, f"{name}: {type(e).__name__}: {e}")
        )


def _token(text: str, field: str = "pullToken") -> PullToken | None:
    """The request's token, checked as an HTTP header value can carry it (never shown)."""
    if not text:
        return None
    if len(text) > 16384 or not all("!" <= ch <= "~" for ch in text):
        raise invalid(field, "visible ASCII characters, at most 16384 (the token is not shown)")
    return PullToken(text)


def container_config(c: Any) -> tuple[dict[str, Any], PullToken | None]:
    """A ContainerConfig as the plain dict the record keeps (the token apart, never kept)."""
    token = _token(str(c.pullToken), "config.pullToken")
    name = _validate.container_name("config.name", str(c.name))
    image = str(c.image)
    _validate.reference("config.image", image)
    mounts = []
    for i, m in enumerate(c.volumeMounts):
        field = f"config.volumeMounts[{i}]"
        path = _validate.container_path(f"{field}.path", str(m.path))
        _validate.check(path != "/etc/resolv.conf", f"{field}.path", "not /etc/resolv.conf")
        mounts.append({"name": _validate.volume_name(f"{field}.name", str(m.name)), "path": path,
                       "readOnly": bool(m.readOnly)})  # fmt: skip
    paths = [m["path"] for m in mounts]
    _validate.check(len(set(paths)) == len(paths), "config.volumeMounts", "each path once")
    workdir = str(c.workingDir)
    config = {
        "name": name, "image": image,
        "command": _validate.texts("config.command", [str(a) for a in c.command]),
        "env": _validate.env("config.env", [str(e) for e in c.env]),
        "volumeMounts": mounts,
        "workingDir": _validate.container_path("config.workingDir", workdir) if workdir else "",
    }  # fmt: skip
    return config, token


def volume(i: int, v: Any) -> dict[str, Any]:
    field = f"volumes[{i}]"
    drive = int(v.drive)
    _validate.check(1 <= drive <= 24, f"{field}.drive", "1 to 24 (0 is the pod's data disk)")
    return {"name": _validate.volume_name(f"{field}.name", str(v.name)), "id": str(v.id),
            "drive": drive, "sizeBytes": int(v.sizeBytes), "format": bool(v.format)}  # fmt: skip


def network(c: Any) -> dict[str, Any]:
    import socket

    ipv6, ipv4, mac = str(c.ipv6), str(c.ipv4), str(c.mac)
    v6 = _validate.ip("config.ipv6", ipv6, socket.AF_INET6) if ipv6 else b""
    if ipv4:
        _validate.ip("config.ipv4", ipv4, socket.AF_INET)
    resolvers = [str(r) for r in c.resolvers]
    _validate.check(len(resolvers) <= 3, "config.resolvers", "at most 3 (resolv.conf's limit)")
    for i, r in enumerate(resolvers):
        _validate.any_ip(f"config.resolvers[{i}]", r)
    mtu = int(c.mtu)
    _validate.check(mtu == 0 or 1280 <= mtu <= 65535, "config.mtu", "0 or 1280 to 65535")
    return {"ipv6": ipv6, "ula": _system.is_ula(v6), "ipv4": ipv4, "resolvers": resolvers,
            "mtu": mtu, "mac": _validate.mac("config.mac", mac) if mac else ""}  # fmt: skip


def fill_state(target: Any, c: _containers.Container) -> None:
    for key, value in _containers.state_dict(c).items():
        setattr(target, key, value)


class GuestServer(guest.GuestService.Server):  # type: ignore[misc]
    def __init__(self, agent: Any) -> None:
        self.a = agent

    # ping and time -----------------------------------------------------------------------

    async def ping_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            r.version, r.bootId = self.a.version, self.a.boot_id
            r.uptimeNs = time.monotonic_ns() - self.a.started_ns

        await guarded("ping", ctx, body)

    async def getTime_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            r.realtimeNs = time.time_ns()

        await guarded("getTime", ctx, body)

    async def adjustTime_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            r.slewed = _system.adjust_time(int(p.offsetNs))

        await guarded("adjustTime", ctx, body)

    async def setTime_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            ns = int(p.realtimeNs)
            _validate.check(ns > 0, "realtimeNs", "after 1970")
            _system.set_time(ns)

        await guarded("setTime", ctx, body)

    # network and volumes -----------------------------------------------------------------

    async def configureNetwork_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            await self.a.configure_network(network(p.config))

        await guarded("configureNetwork", ctx, body)

    async def mountVolumes_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            vols = [volume(i, v) for i, v in enumerate(p.volumes)]
            for key in ("name", "drive"):
                values = [v[key] for v in vols]
                _validate.check(len(set(values)) == len(values), "volumes", f"each {key} once")
            outcomes = await self.a.mount_volumes(vols)
            out = r.init("outcomes", len(outcomes))
            for target, (name, error) in zip(out, outcomes, strict=True):
                target.name, target.mounted, target.error = name, not error, error

        await guarded("mountVolumes", ctx, body)

    # images and containers ---------------------------------------------------------------

    async def pullImage_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            token = _token(str(p.pullToken))
            image, joined = await self.a.images.pull(str(p.reference), token)
            r.digest, r.joined = image.digest, joined

        await guarded("pullImage", ctx, body)

    async def createContainer_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            config, token = container_config(p.config)
            fill_state(r.init("state"), await self.a.containers.create(config, token))

        await guarded("createContainer", ctx, body)

    async def startContainer_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            fill_state(r.init("state"), await self.a.containers.start(str(p.name)))

        await guarded("startContainer", ctx, body)

    async def stopContainer_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            sig = _validate.signal_number("signal", int(p.signal))
            timeout = int(p.timeoutMs) / 1000 or _containers.STOP_TIMEOUT
            fill_state(r.init("state"), await self.a.containers.stop(str(p.name), sig, timeout))

        await guarded("stopContainer", ctx, body)

    async def deleteContainer_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            await self.a.containers.delete(str(p.name))

        await guarded("deleteContainer", ctx, body)

    async def containerState_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            fill_state(r.init("state"), self.a.containers.get(str(p.name)))

        await guarded("containerState", ctx, body)

    async def listContainers_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            all_ = self.a.containers.all()
            for target, c in zip(r.init("containers", len(all_)), all_, strict=True):
                fill_state(target, c)

        await guarded("listContainers", ctx, body)

    async def logs_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            c = self.a.containers.get(str(p.name))
            which = LOG_STREAMS[str(p.source)]
            follow = bool(p.follow)
            r.stream = FileStream(c.log(which), c if follow else None)

        await guarded("logs", ctx, body)

    async def exec_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            argv = _validate.texts("command", [str(a) for a in p.command])
            _validate.check(bool(argv) and bool(argv[0]), "command", "a program and its arguments")
            env = _validate.env("env", [str(e) for e in p.env])
            cwd = str(p.workingDir)
            if cwd and cwd != "/":
                cwd = _validate.container_path("workingDir", cwd)
            terminal = (int(p.rows), int(p.cols)) if p.tty else None
            await self.a.containers.wait_made(str(p.name))
            child, stdin, out, err = await self.a.containers.exec(
                str(p.name), argv, env, bool(p.stdin), cwd=cwd, terminal=terminal
            )
            r.process = ProcessServer(child, stdin, terminal=terminal is not None)
            r.stdout, r.stderr = PipeStream(out), PipeStream(err)

        await guarded("exec", ctx, body)

    # the pod's identity --------------------------------------------------------------------

    async def assume_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            i = p.identity
            entropy = bytes(i.entropy)
            _validate.check(len(entropy) >= 32, "identity.entropy", "32 bytes or more")
            await self.a.assume(str(i.hostname), str(i.machineId), str(i.mac), entropy,
                                int(i.realtimeNs))

        await guarded("assume", ctx, body)

    # the data volume, memory, power ------------------------------------------------------

    async def freezeFilesystem_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            await self.a.freeze(thaw=False)

        await guarded("freezeFilesystem", ctx, body)

    async def thawFilesystem_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            await self.a.freeze(thaw=True)

        await guarded("thawFilesystem", ctx, body)

    async def prepareSuspend_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            loop = asyncio.get_running_loop()
            r.freeBytesBefore, r.freeBytesAfter = await loop.run_in_executor(
                None, _system.prepare_suspend, bool(p.zeroFree)
            )

        await guarded("prepareSuspend", ctx, body)

    async def shutdown_context(self, ctx: Any) -> None:
        async def body(p: Any, r: Any) -> None:
            self.a.request_shutdown(bool(p.reboot))

        await guarded("shutdown", ctx, body)
