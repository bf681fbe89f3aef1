"""The uplink: the join, then reports, events, renewals and JoinMesh, on the link's trio run.

Theory of operation. `Uplink.run` joins while the node has no identity (TokenGate, retried with
the same key, 1 s doubling to 30 s), hands the identity to the node connections, and then talks
to one instance at a time: the ones the control plane listed last, or --control-plane while it
lists none. A call that fails moves the uplink to the next instance at once; after a whole round
of failures it waits 1 s. On one connection a session loops:

  renew, if the certificate's renewal time has come (then a new connection, with the new
  certificate; the node connections take it for their next dials while the old ones drain);
  report, every 3 s or as often as an answer asks, unless the 90 s rule holds (feosd's runtime or
  its pods have not answered for 90 s): the report's collection waits a second at most;
  events, whenever some are pending (an add wakes the session), until the control plane has
  acknowledged them;
  JoinMesh, after the first answered report and whenever the key or the endpoint changes or the
  last answer was not taken by feosd's runtime.

PERMISSION_DENIED on any call after the join means the node was removed: the node connections
are let go, the identity moves into removed-<time>/, and the node joins again on a new token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from ..errors import Code, FeosError
from ._events import EventBuffer
from ._h2client import H2Client, decode, dial, encode, params_type, results_type
from ._identity import CHAIN, KEY, NodeDir, NodeInfo
from ._join import TokenGate, join, uplink
from ._verify import Verifier, client_context

log = logging.getLogger(__name__)

REPORT_S = 3.0
HELD_S = 90.0
BACKOFF_S, BACKOFF_MAX_S = 1.0, 30.0
NODE_ALPN = "feos-node/1"


@attrs.frozen
class LinkConfig:
    control_plane: str
    server_name: str
    trust_domain: str
    token_file: Any
    node_dir: Any
    name: str
    mesh_port: int = 51820
    mesh_address: str | None = None
    pod_prefix: bool = False  # the node has --pod-prefix: JoinMesh only asks


class Connections(Protocol):
    """What the uplink asks of the node connections (feos.fleet NodeConnections)."""

    def set_targets(self, targets: list[Any]) -> None: ...
    def set_ssl_context(self, ctx: Any, verify: Callable[[Any], None] | None = None) -> None: ...


class FeosdSide(Protocol):
    """What the uplink asks of feosd's runtime (feos.fleet._link.Runtime), all thread-safe."""

    def health(self) -> str | None: ...
    async def telemetry(self) -> dict[str, Any]: ...
    def mesh_key(self) -> bytes: ...
    def hand_mesh(self, answer: dict[str, Any]) -> None: ...
    def mesh_taken(self) -> bool: ...


@attrs.define
class UplinkStatus:
    state: str = "waiting"
    instance: str = ""
    last_report_unix_ns: int = 0
    reports_held: bool = False
    mesh: dict[str, Any] = attrs.Factory(dict)
    last_error: str = ""


class Removed(Exception):
    pass


class Renewed(Exception):
    pass


class Uplink:
    def __init__(self, cfg: LinkConfig, runtime: FeosdSide, connections: Connections | None,
                 events: EventBuffer, target: Callable[[str, str], Any]) -> None:
        self.cfg = cfg
        self.node = NodeDir(cfg.node_dir)
        self.gate = TokenGate(cfg.token_file)
        self.runtime = runtime
        self.connections = connections
        self.events = events
        self.target = target  # (address, server name) -> a NodeConnections Target
        self.status = UplinkStatus()
        self.info: NodeInfo | None = None
        self.interval = REPORT_S
        self._wakeup = trio.Event()
        self._ack_moved = trio.Event()
        self._mesh_sent: tuple[bytes, str] | None = None
        self._mesh_due = False
        self._reported = False

    def wake(self) -> None:
        self._wakeup.set()

    # -- the join and the identity ---------------------------------------------------------

    async def run(self) -> None:
        while True:
            self.info = await trio.to_thread.run_sync(
                lambda: self.node.info() if self.node.joined() else None)
            if self.info is None:
                self.info = await self._join()
            await self._use_identity()
            try:
                await self._serve()
            except Removed:
                await self._removed()

    async def _join(self) -> NodeInfo:
        backoff = BACKOFF_S
        while True:
            self.status.state = "joining"
            got = await trio.to_thread.run_sync(self.gate.read)
            if got is None:
                await trio.sleep(2)
                continue
            text, token = got
            try:
                info = await join(self.node, token, address=self.cfg.control_plane,
                                  server_name=self.cfg.server_name,
                                  trust_domain=self.cfg.trust_domain, name=self.cfg.name)
            except (FeosError, trio.TooSlowError) as exc:
                self._failed("the join", exc)
                if isinstance(exc, FeosError) and exc.code == Code.PERMISSION_DENIED:
                    self.gate.refuse(text)
                    self.status.state = "refused"
                    continue
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            log.info("joined the control plane as %s", info.spiffe_id)
            return info

    async def _use_identity(self) -> None:
        bundle = await trio.to_thread.run_sync(self.node.bundle)
        self._roots = bundle
        ctx = client_context(NODE_ALPN, cert=self.node.path / CHAIN, key=self.node.path / KEY)
        if self.connections is not None:
            self.connections.set_ssl_context(ctx, self._verifier(self.cfg.server_name))
        self._set_targets()
        self.status.state = "joined"

    def _verifier(self, server_name: str) -> Verifier:
        return Verifier(server_name, self.cfg.trust_domain, roots=self._roots)

    def _instances(self) -> list[tuple[str, str]]:
        listed = self.info.instances if self.info is not None else ()
        return [(a, self.cfg.server_name) for a in listed or (self.cfg.control_plane,)]

    def _set_targets(self) -> None:
        if self.connections is not None:
            self.connections.set_targets([self.target(a, n) for a, n in self._instances()])

    async def _removed(self) -> None:
        log.error("the control plane refused the node (removed or revoked): its identity moves "
                  "aside and the node joins again on a new token")
        if self.connections is not None:
            self.connections.set_targets([])
        self.gate.refuse_current()
        moved = await trio.to_thread.run_sync(self.node.remove)
        log.warning("the node's identity is kept in %s", moved)
        self.status.state = "removed"
        self._mesh_sent, self._reported = None, False

    # -- the instances ---------------------------------------------------------------------

    async def _serve(self) -> None:
        index, failures = 0, 0
        while True:
            instances = self._instances()
            address, name = instances[index % len(instances)]
            self.status.instance = address
            try:
                client = await self._dial(address, name)
            except (FeosError, trio.TooSlowError) as exc:
                self._failed(f"the uplink to {address}", exc)
                index, failures = index + 1, failures + 1
                if failures % len(instances) == 0:
                    await trio.sleep(BACKOFF_S)
                continue
            try:
                await self._session(client)
            except Renewed:
                continue
            except FeosError as exc:
                if exc.code == Code.PERMISSION_DENIED:
                    raise Removed() from None
                self._failed(f"the uplink to {address}", exc)
                index, failures = index + 1, failures + 1
                if failures % len(instances) == 0:
                    await trio.sleep(BACKOFF_S)
            finally:
                await client.aclose()

    async def _dial(self, address: str, name: str) -> H2Client:
        ctx = client_context("h2", cert=self.node.path / CHAIN, key=self.node.path / KEY)
        return await dial(address, ctx, self._verifier(name), name)

    def _failed(self, what: str, exc: BaseException) -> None:
        text = str(exc) if isinstance(exc, FeosError) else "timed out"
        self.status.last_error = f"{what}: {text}"
        log.warning("%s: %s", what, text)

    # -- a session on one connection -------------------------------------------------------

    async def _session(self, client: H2Client) -> None:
        next_report = trio.current_time()
        while True:
            assert self.info is not None
            self._wakeup = trio.Event()  # before the work: an add meanwhile wakes the next wait
            if time.time_ns() >= self.info.renew_unix_ns:
                await self._renew(client)
            if trio.current_time() >= next_report:
                next_report = trio.current_time() + self.interval
                await self._report(client)
            more = await self._send_events(client) if self.events.count() else False
            if self._reported and self._mesh_wanted(client):
                await self._join_mesh(client)
            if not more:  # unacknowledged events wait for the next report or a new event
                with trio.move_on_at(next_report):
                    await self._wakeup.wait()

    async def _call(self, client: H2Client, method: str, values: dict[str, Any]
                    ) -> dict[str, Any]:
        body = await client.call(f"/uplink/{method}", encode(params_type(uplink(), method),
                                                             values))
        return decode(results_type(uplink(), method), body)

    async def _report(self, client: H2Client) -> None:
        held = self.runtime.health()
        if held is not None:
            await self.runtime.telemetry()  # a collection asked for, to see feosd move again
            if not self.status.reports_held:
                log.error("no reports while %s (the 90 s rule)", held)
            self.status.reports_held = True
            return
        if self.status.reports_held:
            log.warning("feosd answers again: the reports resume")
        self.status.reports_held = False
        telemetry = await self.runtime.telemetry()
        telemetry["meshTaken"] = self.runtime.mesh_taken()
        answer = await self._call(client, "report", {"startId": self.start_id,
                                                     "sequence": self._sequence(),
                                                     "telemetry": telemetry})
        self.status.last_report_unix_ns = time.time_ns()
        interval_ms = int(answer.get("intervalMs", 0))
        if interval_ms > 0:
            self.interval = interval_ms / 1000
        await self._take_instances(answer.get("instances", []))
        if not self._reported or (self._mesh_sent is not None and not telemetry["meshTaken"]):
            self._mesh_due = True  # the first answered report, or an answer not taken
        self._reported = True

    start_id = ""
    _reports = 0

    def _sequence(self) -> int:
        self._reports += 1
        return self._reports

    async def _take_instances(self, listed: list[dict[str, Any]]) -> None:
        instances = tuple(str(i.get("address", "")) for i in listed)
        assert self.info is not None
        if instances != self.info.instances:
            self.info = attrs.evolve(self.info, instances=instances)
            await trio.to_thread.run_sync(self.node.keep_instances, instances)
            self._set_targets()

    async def _send_events(self, client: H2Client) -> bool:
        """The pending events (1024 at a time); whether more wait that may go at once."""
        pending = self.events.pending()
        answer = await self._call(client, "events", {
            "startId": self.start_id, "events": [e.to_dict() for e in pending],
            "dropped": self.events.dropped})
        acknowledged = int(answer.get("acknowledged", 0))
        self.events.acknowledge(acknowledged)
        self._ack_moved.set()
        return acknowledged >= pending[-1].sequence and self.events.count() > 0

    async def acknowledged(self, sequence: int) -> None:
        self.wake()
        while self.events.acknowledged < sequence:
            self._ack_moved = trio.Event()
            await self._ack_moved.wait()

    async def _renew(self, client: H2Client) -> None:
        assert self.info is not None
        csr = await trio.to_thread.run_sync(self.node.csr, self.info.name)
        answer = await self._call(client, "renew", {"csr": csr})
        name, chain, renew = self.info.name, str(answer["chain"]), int(answer.get("renewUnixNs", 0))
        self.info = await trio.to_thread.run_sync(lambda: self.node.keep(name, chain, renew))
        log.info("renewed the node's certificate (renewal next at %s)",
                 time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.info.renew_unix_ns / 1e9)))
        await self._use_identity()
        raise Renewed()

    # -- JoinMesh --------------------------------------------------------------------------

    def _mesh_request(self, client: H2Client) -> tuple[bytes, str]:
        if self.cfg.pod_prefix:
            return b"", ""
        address = self.cfg.mesh_address or _local_address(client)
        host = f"[{address}]" if ":" in address else address
        return self.runtime.mesh_key(), f"{host}:{self.cfg.mesh_port}"

    def _mesh_wanted(self, client: H2Client) -> bool:
        return self._mesh_due or self._mesh_request(client) != self._mesh_sent

    async def _join_mesh(self, client: H2Client) -> None:
        key, endpoint = self._mesh_request(client)
        answer = await self._call(client, "joinMesh", {"publicKey": key, "endpoint": endpoint,
                                                       "askOnly": self.cfg.pod_prefix})
        self._mesh_sent, self._mesh_due = (key, endpoint), False
        mesh = {"meshed": bool(answer.get("meshed")), "ula": str(answer.get("ula", "")),
                "prefix": str(answer.get("prefix", "")), "publicKey": key,
                "port": self.cfg.mesh_port}
        self.status.mesh = mesh
        self.runtime.hand_mesh(mesh)


def _local_address(client: H2Client) -> str:
    stream: Any = client.stream
    sock = stream.transport_stream.socket
    return str(sock.getsockname()[0])
