"""The control-plane link's two sides: its own thread and trio run, and its part on feosd's runtime.

Theory of operation. `Link` runs the uplink and the node connections on a thread of its own with
its own trio run, so a stalled main loop stops neither the reports nor the pings. It starts
with feosd but waits, before the join and every connection, until the resumes of a
suspend-on-stop are done (or two minutes). Nothing of it holds feosd up: READY=1 and the socket
go before it and without it.

`Runtime` is what runs on feosd's runtime for the link: a task that ticks every second, the
pods' events forwarded into the link's buffer, the report's collection (the pods, the installed
versions, the host), and the mesh's answers taken one at a time. The link's thread reaches it only
through `TrioToken.run_sync_soon`, which never blocks, and reads what it left behind: a report
waits a second at most for a fresh collection and takes the last one otherwise. The 90 s rule
(`health`): while the tick or the pods have not answered for 90 s, no report goes out.

The stop (`stop`, from feosd's runtime): a "stopping" (or "upgrading") event, up to 3 s for the
control plane to acknowledge it, then the node connections' graceful stop within a tenth of
--stop-grace (30 s at most), then the uplink ends and the thread with it: feosd lets go of the
control plane for the rest of its life.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from .. import _schema
from ..errors import FeosError
from ..net import mesh_key
from ..records import write_whole
from ._events import EventBuffer
from ._uplink import HELD_S, Connections, LinkConfig, Uplink

log = logging.getLogger(__name__)

RESUMES_WAIT_S = 120.0
ACK_WAIT_S = 3.0
COLLECT_WAIT_S = 1.0
RESTART_S = 5.0


class Runtime:
    """The link's part on feosd's runtime: run() in feosd's nursery, the rest thread-safe."""

    def __init__(self, *, pods: Any, host: Any, events: EventBuffer, mesh_dir: Path,
                 take_mesh: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> None:
        self._pods, self._host = pods, host
        self._take = take_mesh  # the network's (feos.net Network.take_mesh); else kept here
        self.events = events
        self.mesh_dir = mesh_dir
        self.last_tick = time.monotonic()
        self.held_s = _held_s()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._lock = threading.Lock()
        self._collected: dict[str, Any] = {"pods": [], "podsUnixNs": 0, "versions": {},
                                           "versionsUnixNs": 0, "node": {}}
        self._collecting = False
        self._collect_started = 0.0
        self._fresh: list[Callable[[], None]] = []
        self._mesh_taken = True
        self._mesh_key: bytes | None = None
        self._taking = trio.Lock()  # the mesh's answers taken one at a time

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._tick)
            nursery.start_soon(self._forward_events)
            task_status.started()

    async def _tick(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await trio.sleep(1)

    async def _forward_events(self) -> None:
        hub = getattr(self._pods, "events", None)
        if hub is None:
            return
        watcher = hub.watch(size=1024)
        try:
            while True:
                got = await watcher.next({"max": 256})
                for e in got["events"]:
                    self.events.add("pod", pod_id=e["podId"], state=e["state"],
                                    reason=e["reason"], step=e["step"], deleted=e["deleted"])
                if got["end"]:
                    return
        finally:
            watcher.close()

    # -- called from the link's thread -----------------------------------------------------

    def health(self) -> str | None:
        now = time.monotonic()
        if now - self.last_tick > self.held_s:
            return f"feosd's runtime has not ticked for {now - self.last_tick:.0f} s"
        with self._lock:
            waiting = now - self._collect_started if self._collecting else 0.0
        if waiting > self.held_s:
            return f"the pods have not answered for {waiting:.0f} s"
        return None

    async def telemetry(self) -> dict[str, Any]:
        """The last collection, a fresh one if it comes within a second (on the link's run)."""
        fresh = trio.Event()
        token = trio.lowlevel.current_trio_token()
        self._ask(lambda: token.run_sync_soon(fresh.set))
        with trio.move_on_after(COLLECT_WAIT_S):
            await fresh.wait()
        with self._lock:
            return dict(self._collected)

    def _ask(self, done: Callable[[], None]) -> None:
        with self._lock:
            self._fresh.append(done)
            if self._collecting or self._token is None:
                return
            self._collecting = True
            self._collect_started = time.monotonic()
        try:
            self._token.run_sync_soon(self._start_collection)
        except trio.RunFinishedError:
            pass

    def _start_collection(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._collect)

    async def _collect(self) -> None:
        try:
            pods = (await self._pods.list_pods({}))["pods"] if self._pods is not None else []
            self._store(pods=[_reportable(p) for p in pods], podsUnixNs=time.time_ns())
            node = (await self._host.get_host_info({}))["info"]  # its versions: installed ones
            self._store(node=node, versions=node["version"], versionsUnixNs=time.time_ns())
        except Exception as exc:  # a report goes out with what it had
            log.warning("the report's collection: %r", exc)
        finally:
            with self._lock:
                self._collecting = False
                waiting, self._fresh = self._fresh, []
            for done in waiting:
                try:
                    done()
                except trio.RunFinishedError:
                    pass

    def _store(self, **values: Any) -> None:
        with self._lock:
            self._collected.update(values)

    # -- the mesh --------------------------------------------------------------------------

    def mesh_key(self) -> bytes:
        """The mesh's WireGuard public key; its private key made once, in mesh/key."""
        if self._mesh_key is None:
            self._mesh_key = mesh_key(self.mesh_dir / "key")[1]
        return self._mesh_key

    def mesh_taken(self) -> bool:
        return self._mesh_taken

    def hand_mesh(self, answer: dict[str, Any]) -> None:
        self._mesh_taken = False
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(self._start_take, answer)
        except trio.RunFinishedError:
            pass

    def _start_take(self, answer: dict[str, Any]) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._take_mesh, answer)

    async def _take_mesh(self, answer: dict[str, Any]) -> None:
        async with self._taking:
            try:
                if self._take is not None:
                    await self._take(answer)
                else:
                    await trio.to_thread.run_sync(keep_mesh, self.mesh_dir, answer)
            except FeosError as e:  # not taken: asked for again after the next report
                log.error("the mesh's answer was not taken: %s", e.message)
                return
            self._mesh_taken = True
        log.info("the mesh: %s", f"{answer['ula']}, the node's {answer['prefix']}"
                 if answer["meshed"] else "the cluster is not meshed")


def _reportable(pod: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in pod.items() if k != "containers"}


def keep_mesh(mesh_dir: Path, answer: dict[str, Any]) -> None:
    """mesh/mesh.pb (a feos.network Mesh): the /64 and the /96, the peers kept as they were."""
    mesh_type = _schema.network().Mesh
    path = mesh_dir / "mesh.pb"
    mesh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    values: dict[str, Any] = {}
    try:
        with mesh_type.from_bytes(path.read_bytes()) as old:
            values = old.to_dict()
    except (FileNotFoundError, ValueError):
        pass
    except Exception as exc:  # a broken record: rewritten whole
        log.warning("%s: %r; written anew", path, exc)
    values.update(ula=answer["ula"], nodePrefix=answer["prefix"],
                  publicKey=answer["publicKey"], port=answer["port"])
    write_whole(path, mesh_type.new_message(**values).to_bytes())


class Link:
    """The link's thread: started at once, serving once the resumes are done."""

    def __init__(self, cfg: LinkConfig, runtime: Runtime, connections: Any | None,
                 target: Callable[[str, str], Any]) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.connections = connections
        self.uplink = Uplink(cfg, runtime, connections, runtime.events, target)
        self.uplink.start_id = secrets.token_hex(8)
        self.uplink.status.state = "waiting for the resumes"
        self._resumed = threading.Event()
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._thread: threading.Thread | None = None
        runtime.events.wake = self._wake

    def start(self) -> None:
        self.runtime.events.add("started")
        self._thread = threading.Thread(target=trio.run, args=(self._main,),
                                        name="feos-control-plane", daemon=True)
        self._thread.start()
        self._started.wait(5)

    def resumes_done(self) -> None:
        self._resumed.set()

    def _wake(self) -> None:
        if self._token is not None:
            try:
                self._token.run_sync_soon(self.uplink.wake)
            except trio.RunFinishedError:
                pass

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            self._started.set()
            await trio.to_thread.run_sync(self._resumed.wait, RESUMES_WAIT_S,
                                          abandon_on_cancel=True)
            async with trio.open_nursery() as nursery:
                if self.connections is not None:
                    await nursery.start(self.connections.run)
                nursery.start_soon(self._supervised)
        self.uplink.status.state = "stopped"

    async def _supervised(self) -> None:
        """The uplink, started again after a fault of its own: the link outlives its bugs."""
        while True:
            try:
                await self.uplink.run()
            except Exception:
                log.exception("the uplink failed; it starts again in 5 s")
                self.uplink.status.last_error = "the uplink failed (feosd's log says why)"
            await trio.sleep(RESTART_S)

    async def stop(self, grace: float, kind: str = "stopping") -> None:
        """From feosd's runtime: tell the control plane, close the node connections, end."""
        if self._thread is None or self._token is None:
            return
        await trio.to_thread.run_sync(self.stop_blocking, grace, kind)

    def stop_blocking(self, grace: float, kind: str = "stopping") -> None:
        """The stop, from a thread that is not the link's (feosd's stop runs it on a worker)."""
        if self._thread is None or self._token is None:
            return
        try:
            trio.from_thread.run(self._stop_in_link, grace, kind, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        assert self._thread is not None
        self._thread.join(10)

    async def _stop_in_link(self, grace: float, kind: str) -> None:
        sequence = self.runtime.events.add(kind)
        if self.uplink.status.state == "joined":
            with trio.move_on_after(ACK_WAIT_S) as scope:
                await self.uplink.acknowledged(sequence)
            if scope.cancelled_caught:
                log.warning("the control plane did not acknowledge the %s event within 3 s", kind)
        if self._resumed.is_set() and self.connections is not None:
            log.info("closing the node connections (their calls: %gs at most)",
                     min(grace / 10, 30.0))
            await self.connections.stop(min(grace / 10, 30.0))
        log.info("the control-plane link ends")
        assert self._cancel is not None
        self._cancel.cancel()

    def info(self) -> dict[str, Any]:
        """feosctl host control-plane: the identity, the connections, the uplink (thread-safe)."""
        status = self.uplink.status
        ident = self.uplink.info
        connections = []
        try:
            connections = list(self.connections.info()) if self.connections is not None else []
        except Exception as exc:  # the connections' view is not worth failing the call for
            log.debug("the node connections' info: %r", exc)
        mesh = status.mesh
        return {
            "configured": True, "controlPlane": self.cfg.control_plane,
            "identity": {"name": ident.name, "spiffeId": ident.spiffe_id,
                         "notAfterUnixNs": ident.not_after_unix_ns,
                         "renewUnixNs": ident.renew_unix_ns} if ident else {},
            "connections": [_connection(c) for c in connections],
            "uplink": {"state": status.state, "instance": status.instance,
                       "lastReportUnixNs": status.last_report_unix_ns,
                       "reportsHeld": status.reports_held,
                       "eventsPending": self.runtime.events.count(),
                       "eventsDropped": self.runtime.events.dropped,
                       "meshed": bool(mesh.get("meshed")), "meshUla": mesh.get("ula", ""),
                       "meshPrefix": mesh.get("prefix", ""), "lastError": status.last_error},
        }


def _connection(c: dict[str, Any]) -> dict[str, Any]:
    """A row of NodeConnections.info() as a NodeConnection of schema/host.capnp."""
    parts = []
    if c.get("connectedSince"):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(c["connectedSince"])))
        parts.append(f"since {since} UTC")
    if c.get("redialIn") is not None:
        parts.append(f"redial in {float(c['redialIn']):.0f}s")
    if c.get("lastError"):
        parts.append(f"last error: {c['lastError']}")
    detail = ", ".join(parts)
    return {"address": str(c.get("target", "")), "serverName": str(c.get("serverName", "")),
            "state": str(c.get("state", "")), "streams": int(c.get("openStreams", 0) or 0),
            "detail": detail}


__all__ = ["Connections", "Link", "LinkConfig", "Runtime"]


def _held_s() -> float:
    """The 90 s rule's seconds; a test (FEOSD_TEST_HOOKS=1 only) may shorten it with
    FEOSD_TEST_HELD_S, so that it need not stall feosd for 100 s to see the rule hold."""
    if os.environ.get("FEOSD_TEST_HOOKS") == "1" and "FEOSD_TEST_HELD_S" in os.environ:
        return float(os.environ["FEOSD_TEST_HELD_S"])
    return HELD_S
