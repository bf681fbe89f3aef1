"""A test control plane: the join and the uplink as HTTP/2 over TLS 1.3, on loopback, on a thread.

`ControlPlane(tmp_path).start()` serves on 127.0.0.1 (its own trio run on a thread of the test
process) with a CA of controlplane_ca (a root with a URI name constraint, an intermediate, the
server's certificate for `server_name` and spiffe://<trust domain>/ferun). It takes joins for the
secrets in `tokens` (others are refused with PERMISSION_DENIED and counted), issues the nodes'
certificates from their signing requests, lists `instances`, takes reports and events (and
acknowledges them), answers JoinMesh with `ula` and `prefix`, renews, and refuses the nodes in
`removed` with PERMISSION_DENIED. It also takes node connections (ALPN feos-node/1) as the HTTP/2
client (tests/fleet_push.py's PushClient), counts them, and pushes calls on them (`push`).

Tests read what it saw (`joins`, `refused`, `reports`, `events`, `mesh_calls`, `renewals`,
`node_connections`) and wait with `wait_for`.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import trio
from controlplane_ca import TestCA, key_pem, pem
from fleet_push import PushClient

from feos.errors import Code
from feos.fleet._h2client import decode, encode, params_type, results_type
from feos.fleet._join import uplink


class Refuse(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ControlPlane:
    def __init__(self, root: Path, *, ca: TestCA | None = None, tokens: tuple[str, ...] = ("s3cret",),
                 instances: list[dict[str, str]] | None = None, renew_in_s: float = 0,
                 ula: str = "fd12:3456:789a:1::/64", prefix: str = "fd12:3456:789a:1:0:1::/96",
                 port: int = 0, netns: str | None = None, host: str = "127.0.0.1") -> None:
        self.root = root
        self.netns = netns  # where it listens (127.0.0.1 of that namespace), else here
        self.host = host
        self.ca = ca or TestCA()
        self.tokens = set(tokens)
        self.instances = instances or []
        self.renew_in_s = renew_in_s
        self.ula, self.prefix = ula, prefix
        self.ack_events = True
        self.removed: set[str] = set()
        self.joins: list[tuple[str, str]] = []
        self.refused: list[str] = []
        self.reports: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.mesh_calls: list[dict[str, Any]] = []
        self.mesh_nodes: dict[str, dict[str, Any]] = {}  # by node: its key, endpoint and /96
        self.pusher_of: dict[str, PushClient] = {}  # the newest node connection of each node
        self.renewals = 0
        self.node_connections = 0
        self.pushers: list[PushClient] = []
        self.port = port
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._nursery: Any = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def token(self, secret: str = "s3cret", pin: str | None = None) -> str:
        return f"feos-join-{secret}.{pin or self.ca.pin}"

    # -- running ---------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the test control plane did not start"
        return self

    def _run(self) -> None:
        from feos.net._links import netns_entered

        with netns_entered(self.netns):  # this thread's sockets are the namespace's
            trio.run(self._main)

    def stop(self) -> None:
        if self._token is not None and self._cancel is not None:
            try:
                self._token.run_sync_soon(self._cancel.cancel)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, what: Callable[[], Any], timeout: float = 30.0, why: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"the test control plane did not see {why or what} within {timeout}s")

    def _context(self) -> ssl.SSLContext:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "cp-chain.pem").write_text(pem(*self.ca.server_chain()))
        (self.root / "cp-key.pem").write_bytes(key_pem(self.ca.server_key))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.root / "cp-chain.pem", self.root / "cp-key.pem")
        ctx.verify_mode = ssl.CERT_OPTIONAL  # the join comes without a certificate
        ctx.load_verify_locations(cadata=self.ca.bundle_pem())
        ctx.set_alpn_protocols(["h2", "feos-node/1"])
        return ctx

    async def _main(self) -> None:
        ctx = self._context()
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
            self.port = listeners[0].socket.getsockname()[1]
            self._ready.set()
            ssl_listeners = [trio.SSLListener(lis, ctx, https_compatible=True) for lis in listeners]
            async with trio.open_nursery() as self._nursery:
                await trio.serve_listeners(self._connection, ssl_listeners)

    async def _connection(self, stream: trio.SSLStream[Any]) -> None:
        try:
            await stream.do_handshake()
            if stream.selected_alpn_protocol() == "feos-node/1":
                self.node_connections += 1
                await self._hold_node_connection(stream)
            else:
                await self._serve_h2(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _hold_node_connection(self, stream: trio.SSLStream[Any]) -> None:
        client = PushClient(stream)
        self.pushers.append(client)
        name = self._peer_name(stream)
        if name is not None:
            self.pusher_of[name] = client
        try:
            await client.run()
        finally:
            self.pushers.remove(client)
            if name is not None and self.pusher_of.get(name) is client:
                del self.pusher_of[name]

    def watch(self, service: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A stream pushed over the newest node connection, read on in the background: its
        items, then its status (`status`, None while it runs) in the dict returned."""
        self.wait_for(lambda: self.pushers, why="a node connection")
        seen: dict[str, Any] = {"items": [], "status": None, "opened": threading.Event()}
        client = self.pushers[-1]

        async def read() -> None:
            async with client.stream_call(service, method, params) as stream:
                seen["first"] = await stream.first()
                seen["opened"].set()
                while (item := await stream.item()) is not None:
                    seen["items"].append(item)
                seen["status"] = stream.status

        assert self._token is not None
        self._token.run_sync_soon(lambda: self._nursery.start_soon(read))
        assert seen["opened"].wait(30), "the stream did not open"
        return seen

    def push(self, service: str, method: str, params: dict[str, Any] | None = None,
             timeout: float = 30.0, node: str | None = None) -> dict[str, Any]:
        """A call pushed over the newest node connection (tests/fleet_push.py), from any thread;
        with `node`, over that node's."""
        if node is None:
            self.wait_for(lambda: self.pushers, timeout, why="a node connection")
        else:
            self.wait_for(lambda: node in self.pusher_of, timeout, why=f"{node}'s connection")

        async def call() -> dict[str, Any]:
            with trio.fail_after(timeout):
                client = self.pushers[-1] if node is None else self.pusher_of[node]
                return await client.call(service, method, params)

        assert self._token is not None
        return trio.from_thread.run(call, trio_token=self._token)

    # -- the mesh: a /96 per node, the others its peers ----------------------------------------

    def mesh_peers_of(self, node: str, *, without: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        return [dict(m) for n, m in sorted(self.mesh_nodes.items())
                if n != node and n not in without]

    def put_mesh_peers(self, version: int, *, without: tuple[str, ...] = ()) -> None:
        """PutMeshPeers to every joined node: the others (but `without`) its peers."""
        for node in sorted(self.mesh_nodes):
            if node not in without:
                self.push("mesh", "putMeshPeers",
                          {"version": version, "peers": self.mesh_peers_of(node, without=without)},
                          node=node)

    # -- the uplink's HTTP/2 ---------------------------------------------------------------

    async def _serve_h2(self, stream: trio.SSLStream[Any]) -> None:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        peer = self._peer_name(stream)
        calls: dict[int, tuple[dict[bytes, bytes], bytearray]] = {}
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    calls[event.stream_id] = (dict(event.headers), bytearray())
                elif isinstance(event, h2.events.DataReceived):
                    calls[event.stream_id][1].extend(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    headers, body = calls.pop(event.stream_id)
                    self._answer(conn, event.stream_id, headers[b":path"].decode(), bytes(body), peer)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    await stream.send_all(conn.data_to_send())
                    return
            await stream.send_all(conn.data_to_send())

    def _peer_name(self, stream: trio.SSLStream[Any]) -> str | None:
        cert = stream.getpeercert()
        if not cert:
            return None
        for kind, value in cert.get("subjectAltName", ()):
            if kind == "URI" and value.startswith(f"spiffe://{self.ca.trust_domain}/node/"):
                return str(value.rsplit("/", 1)[1])
        return None

    def _answer(self, conn: h2.connection.H2Connection, sid: int, path: str, body: bytes,
                peer: str | None) -> None:
        method = path.rsplit("/", 1)[-1]
        results = results_type(uplink(), method)
        try:
            params = decode(params_type(uplink(), method), body)
            values = getattr(self, f"_on_{method}")(params, peer)
            code, message, data = Code.OK, "", encode(results, values)
        except Refuse as exc:
            code, message, data = exc.code, exc.message, b""
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/x-capnp")])
        if data:
            conn.send_data(sid, data)
        conn.send_headers(sid, [(b"feos-status", str(int(code)).encode()),
                                (b"feos-message", urllib.parse.quote(message).encode())],
                          end_stream=True)

    def _node(self, peer: str | None) -> str:
        if peer is None:
            raise Refuse(Code.UNAUTHENTICATED, "no node certificate")
        if peer in self.removed:
            raise Refuse(Code.PERMISSION_DENIED, f"the node {peer} was removed")
        return peer

    def _on_join(self, params: dict[str, Any], peer: str | None) -> dict[str, Any]:
        secret, name = params["secret"], params["name"]
        if secret not in self.tokens:
            self.refused.append(secret)
            raise Refuse(Code.PERMISSION_DENIED, "the join token is not valid")
        self.joins.append((secret, name))
        self.removed.discard(name)
        return {"chain": self.ca.issue_node(params["csr"], name), "bundle": self.ca.bundle_pem(),
                "instances": self.instances, "renewUnixNs": self._renew_at()}

    def _renew_at(self) -> int:
        return int((time.time() + self.renew_in_s) * 1e9) if self.renew_in_s else 0

    def _on_report(self, params: dict[str, Any], peer: str | None) -> dict[str, Any]:
        params["node"] = self._node(peer)
        params["at"] = time.monotonic()
        self.reports.append(params)
        return {"intervalMs": 0, "instances": self.instances}

    def _on_events(self, params: dict[str, Any], peer: str | None) -> dict[str, Any]:
        self._node(peer)
        seen = {(e["startId"], e["sequence"]) for e in self.events}
        for e in params.get("events", []):
            if (params["startId"], e["sequence"]) not in seen:
                self.events.append({**e, "startId": params["startId"]})
        top = max((e["sequence"] for e in params.get("events", [])), default=0)
        return {"acknowledged": top if self.ack_events else 0}

    def _on_renew(self, params: dict[str, Any], peer: str | None) -> dict[str, Any]:
        name = self._node(peer)
        self.renewals += 1
        return {"chain": self.ca.issue_node(params["csr"], name), "renewUnixNs": self._renew_at()}

    def _on_joinMesh(self, params: dict[str, Any], peer: str | None) -> dict[str, Any]:
        name = self._node(peer)
        self.mesh_calls.append(params)
        known = self.mesh_nodes.get(name)
        prefix = known["prefix"] if known else self._next_prefix()
        if params.get("publicKey"):
            self.mesh_nodes[name] = {"publicKey": params["publicKey"],
                                     "endpoint": params["endpoint"], "prefix": prefix}
        return {"meshed": True, "ula": self.ula, "prefix": prefix}

    def _next_prefix(self) -> str:
        """The first node's /96 is `prefix`, each next node's the /96 after the last one's."""
        import ipaddress

        first = ipaddress.IPv6Network(self.prefix)
        n = len(self.mesh_nodes)
        return str(ipaddress.IPv6Network((int(first.network_address) + (n << 32), 96)))
