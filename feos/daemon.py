"""feosd's main: options, the lock, the listeners, the services, and a clean stop.

Theory of operation: `main` parses the options and runs `serve` under trio. `serve` takes the
node's lock (waiting as long as another feosd holds it), becomes the subreaper of its children,
starts the Cap'n Proto thread, loads the records, binds the API's listeners (or takes them over
from the feosd that exec'd it in a self-upgrade), tells systemd it is ready, and serves until
SIGTERM or SIGINT, or until an upgrade replaces it with a new program under the same pid.

The stop (`_stop_pods`) first refuses every new pod change with UNAVAILABLE "feosd stops", then
(with --suspend-on-stop) suspends the running pods, then lets the changes in flight end within
--stop-grace; only the ones still running then are cancelled, and only then do the services'
nurseries end (docs/pods.md, "The node's stop").
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from . import _schema, native
from ._codec import snake
from ._host import HostService, own_binary, replace_binary, vmm_info
from ._lock import take_lock
from ._reaper import REAPER
from ._sdnotify import notify
from ._sockpath import bind_unix
from .disk import WAIT_S as DISKD_WAIT_S
from .disk import Diskd
from .errors import FeosError
from .net import (
    DnsSockets,
    Mesh,
    NameTableService,
    Network,
    NoMesh,
    SecurityGroupService,
    add_network_arguments,
    network_options_from_args,
    prepare_exec,
    take_dns_sockets,
)
from .pods import PodService, SuspendedForStop, TemplateApi, VolumeService
from .rpc import (
    Cap,
    CapnpThread,
    ServerContexts,
    ServerTls,
    capnp_thread,
    close_listeners,
    is_loopback,
    listen,
    own_certificate,
    pin_of,
)
from .rpc import serve as serve_interface
from .vmm import MicroVms, choose_vmm, installed_guests

if TYPE_CHECKING:
    from .fleet import Link

log = logging.getLogger("feosd")

STOP_MARGIN_S = 5.0  # of --stop-grace, for what the stop does after the pods' changes
LISTEN_VARIABLE = "FEOS_LISTEN_FDS"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="feosd", description="The feos node agent: pods as microVMs.")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/feos"),
        help="records, the lock and the microVMs' directories (default /var/lib/feos)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("/run/feos"),
        help="the API socket api.sock and runtime state (default /run/feos)",
    )
    tcp = p.add_argument_group("the API on TCP (docs/api.md, \"TCP\")")
    tcp.add_argument("--tcp", metavar="ADDRESS",
                     help="also serve the API on TCP, such as [::]:1337: TLS with --tcp-client-ca, "
                     "plain only on loopback or with --tcp-insecure")
    tcp.add_argument("--tcp-client-ca", type=Path, metavar="FILE",
                     help="serve --tcp over TLS 1.3 to clients whose certificate one of these CAs "
                     "(PEM) issued, or, once the node has joined, the control plane's bundle")
    tcp.add_argument("--tcp-cert", type=Path, metavar="FILE",
                     help="the server's certificate chain (PEM) for --tcp (default: feosd's own, "
                     "made once in <state-dir>/tls/, checked by its pin)")
    tcp.add_argument("--tcp-key", type=Path, metavar="FILE", help="the key of --tcp-cert (PEM)")
    tcp.add_argument("--tcp-insecure", action="store_true",
                     help="serve --tcp plain, without authentication, on any address: whoever "
                     "reaches it can do on the node what root can")
    p.add_argument("--disk-socket", type=Path, default=None, metavar="PATH",
                   help="diskd's socket, which serves the pods' disks (default "
                   "<state-dir>/disk/diskd.sock)")
    p.add_argument("--disk-wait", type=float, default=None, metavar="SECONDS",
                   help="how long a pod that needs a disk waits for diskd to answer "
                   "(default 120)")
    p.add_argument("--web", metavar="ADDRESS:PORT",
                   help="serve the web console, such as 127.0.0.1:8080 (off loopback: a token)")
    p.add_argument("--warm-templates", type=_shapes, default=[], metavar="SHAPES",
                   help="pod templates to keep made, as VCPUSxMEMORY_MIB[+net][=IMAGE] separated "
                   "by commas, such as 1x512+net,2x1024,1x512+net=registry.example/app:1 (=IMAGE: "
                   "the template's guest holds that image; docs/templates.md)")
    p.add_argument("--templates-on-first-use", action="store_true",
                   help="make a pod template when a create finds none that fits (that create "
                   "boots cold; the next restore)")
    p.add_argument(
        "--self-upgrade",
        action="store_true",
        help="allow HostService.UpgradeFeosBinary to replace and re-execute feosd",
    )
    p.add_argument(
        "--suspend-on-stop",
        action="store_true",
        help="on SIGTERM suspend the running pods for the next feosd",
    )
    p.add_argument(
        "--stop-grace",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a stop may take before feosd is killed: the pods' changes in flight "
        "end within it, and are cancelled only then (default 300)",
    )
    p.add_argument(
        "--vmm",
        choices=["auto", "firecracker", "qemu"],
        default="auto",
        help="what boots new pods: auto (Firecracker where it boots the guest under KVM, else "
        "QEMU under KVM, else QEMU on TCG), firecracker (or feosd does not start), qemu "
        "(KVM if it works, else TCG); default auto (docs/vmm.md)",
    )
    p.add_argument(
        "--vms-cgroup",
        metavar="PATH",
        help="the cgroup the microVMs' vms/<id> go below, as /proc/self/cgroup names it, such "
        "as /system.slice/feos-vms.service (default: beside feosd, below its own cgroup)",
    )
    p.add_argument(
        "--hand-over-vms",
        action="store_true",
        help="move the microVMs a feosd left below its own unit's cgroup into --vms-cgroup, "
        "then exit (feosd.service's ExecStopPost=)",
    )
    add_network_arguments(p.add_argument_group("the pods' network"))
    cp = p.add_argument_group("the control plane (docs/control-plane.md)")
    cp.add_argument("--control-plane", metavar="HOST:PORT",
                    help="join the control plane there and connect to its instances")
    cp.add_argument("--control-plane-name",
                    help="the DNS name its certificate must carry (default: HOST)")
    cp.add_argument("--trust-domain", default="feos.local")
    cp.add_argument("--join-token-file", type=Path, default=Path("/etc/feos/join-token"))
    cp.add_argument("--node-dir", type=Path, help="the node's identity (default <state-dir>/node)")
    cp.add_argument("--mesh-port", type=int, default=51820)
    cp.add_argument("--mesh-address")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if args.hand_over_vms and not args.vms_cgroup:
        p.error("--hand-over-vms: needs --vms-cgroup")
    if args.vms_cgroup is not None and not args.vms_cgroup.startswith("/"):
        p.error("--vms-cgroup: must be a cgroup path starting with /")
    if args.stop_grace <= 0:
        p.error("--stop-grace: must be a positive number of seconds")
    if args.control_plane is not None:
        host, sep, port = args.control_plane.rpartition(":")
        if not sep or not host or not port.isdigit():
            p.error("--control-plane: must be HOST:PORT ([v6]:PORT)")
        args.control_plane_name = args.control_plane_name or host.strip("[]")
    if args.tcp is not None:
        try:
            args.tcp_address = parse_tcp(args.tcp)
        except ValueError as exc:
            p.error(f"--tcp: {exc}")
    problem = tcp_options_problem(args)
    if problem is not None:
        p.error(problem)
    if args.web is not None:
        from .web import parse_web_address

        try:
            args.web_address = parse_web_address(args.web)
        except ValueError as exc:
            p.error(f"--web: {exc}")
    try:
        args.network = network_options_from_args(args)
    except FeosError as exc:
        p.error(exc.message)
    return args


def _shapes(text: str) -> list[Any]:
    from .errors import FeosError
    from .pods import TemplateWarm

    try:
        return [TemplateWarm.parse(part.strip()) for part in text.split(",") if part.strip()]
    except FeosError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def parse_tcp(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT (such as [::]:1337 or 127.0.0.1:1337)")
    return host.strip("[]") or "::", int(port)


def tcp_options_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the TCP options together, naming the option; None if nothing."""
    given = [name for name, value in (("--tcp-client-ca", args.tcp_client_ca),
                                      ("--tcp-cert", args.tcp_cert), ("--tcp-key", args.tcp_key),
                                      ("--tcp-insecure", args.tcp_insecure)) if value]
    if args.tcp is None:
        return f"{given[0]}: needs --tcp" if given else None
    if (args.tcp_cert is None) != (args.tcp_key is None):
        return ("--tcp-cert: needs --tcp-key" if args.tcp_key is None
                else "--tcp-key: needs --tcp-cert")
    if args.tcp_client_ca is None:
        if args.tcp_cert is not None:
            return "--tcp-cert: needs --tcp-client-ca (TLS asks every client for a certificate)"
        if not args.tcp_insecure and not is_loopback(args.tcp_address[0]):
            return (f"--tcp {args.tcp}: not a loopback address: needs --tcp-client-ca FILE "
                    "(TLS with client certificates) or --tcp-insecure")
    elif args.tcp_insecure:
        return "--tcp-insecure: contradicts --tcp-client-ca"
    return None


def tcp_tls(args: argparse.Namespace, node_dir: Path) -> ServerContexts | None:
    """The TCP listener's TLS (a bad file refuses the start), or None for a plain one, warned."""
    if args.tcp_client_ca is None:
        where = "this machine" if is_loopback(args.tcp_address[0]) else "the network"
        log.warning("the API on TCP %s is plain, without authentication: anyone on %s who reaches "
                    "it can do on the node what root can", args.tcp, where)
        return None
    cert, key = args.tcp_cert, args.tcp_key
    if cert is None:
        cert, key = own_certificate(args.state_dir / "tls")
        log.info("the API on TCP: feosd's own certificate %s, pin %s (feosctl --tls-pin)",
                 cert, pin_of(cert))
    return ServerContexts(ServerTls(args.tcp_client_ca, cert, key, node_dir / "bundle.pem",
                                    cert_option="--tcp-cert" if args.tcp_cert
                                    else "feosd's own certificate",
                                    key_option="--tcp-key" if args.tcp_key else "feosd's own key"))


# -- listeners ---------------------------------------------------------------------------------


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on a socket whose proto says TCP,
    # and without it every call waits 40 ms for a delayed ACK (Nagle's algorithm)
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def inherited_listeners(environ: dict[str, str]) -> dict[str, socket.socket]:
    """The listeners a self-upgrade handed over: FEOS_LISTEN_FDS=api:N,tcp:M."""
    spec = environ.pop(LISTEN_VARIABLE, "")
    found: dict[str, socket.socket] = {}
    for item in filter(None, spec.split(",")):
        name, _, fd = item.partition(":")
        sock = socket.socket(fileno=int(fd))
        sock.set_inheritable(False)
        found[name] = sock
    return found


# -- the daemon --------------------------------------------------------------------------------


class Daemon:
    def __init__(self, args: argparse.Namespace, dns_sockets: DnsSockets | None = None) -> None:
        self.args = args
        self.dns_sockets = dns_sockets
        self.network: Network | None = None
        self.state_dir: Path = args.state_dir
        self.run_dir: Path = args.run_dir
        self.node_dir: Path = args.node_dir or self.state_dir / "node"
        self.volumes = VolumeService(self.state_dir)
        self.groups = SecurityGroupService(self.state_dir, in_use=self.pods_naming_group)
        self.names = NameTableService(self.state_dir, in_use=self.pods_naming_table)
        self.host = HostService(
            state_dir=self.state_dir,
            self_upgrade=args.self_upgrade,
            binary=own_binary(),
            upgrade=self.request_upgrade,
            versions=self.versions,
            vmm=self.vmm_info,
            control_plane=self.control_plane_info,
            mesh_device=lambda: self.mesh.kind,
        )
        self.mesh = self._mesh()
        self.link: Link | None = None
        self.listeners: dict[str, socket.socket] = {}
        self.handover: dict[str, int] = {}
        self.vms: MicroVms | None = None
        self.pods: PodService | None = None
        self.diskd: Diskd | None = None
        self.stop_record = SuspendedForStop(self.state_dir / "suspended-for-stop.json",
                                            control_plane=args.control_plane is not None)
        self._upgrade_send, self._upgrade_receive = trio.open_memory_channel[Path](1)

    def _mesh(self) -> Mesh | NoMesh:
        """On a mesh: a node with --control-plane and without --pod-prefix."""
        args = self.args
        if args.control_plane is None or args.network.pod_prefix is not None:
            return NoMesh()
        node_dir = args.node_dir or self.state_dir / "node"
        return Mesh(node_dir / "mesh", self.run_dir, args.mesh_port)

    def pods_naming_group(self, group_id: str) -> list[str]:
        return self.pods.pods_naming_group(group_id) if self.pods is not None else []

    def pods_naming_table(self, table_id: str) -> list[str]:
        return self.pods.pods_naming_table(table_id) if self.pods is not None else []

    def versions(self) -> dict[str, Any]:
        from .vmm import guest_root
        from .vmm import installed_firecrackers as installed

        try:
            firecrackers = [i.version for i in reversed(installed())]
        except Exception:  # a broken install is reported as none
            firecrackers = []
        choice = self.vms.choice if self.vms is not None else None
        return {"guests": installed_guests(guest_root()), "firecrackers": firecrackers,
                "driver": choice.driver if choice else "",
                "accel": f"{choice.accel} ({choice.reason})" if choice else
                         self.vms.probing() if self.vms is not None else "",
                "network": self.network_status()}

    def vmm_info(self) -> dict[str, Any]:
        vms = self.vms.list() if self.vms is not None else []
        return vmm_info(self.vms.choice if self.vms else None, [vm.driver for vm in vms],
                        self.vms.probing() if self.vms else "")

    def control_plane_info(self) -> dict[str, Any]:
        return self.link.info() if self.link is not None else {"configured": False}

    def network_status(self) -> str:
        if self.network is None:
            return "not started"
        reason = self.network.unavailable()
        return "up" if reason is None else f"not set up: {reason}"

    def request_upgrade(self, staged: Path) -> None:
        try:
            self._upgrade_send.send_nowait(staged)
        except trio.WouldBlock:
            from .errors import Code, FeosError

            raise FeosError(Code.ABORTED, "an upgrade is already under way") from None

    def services(self) -> dict[str, object]:
        """The API's services by the bootstrap's names: the socket's and the node connections'."""
        return {"volumes": self.volumes, "securityGroups": self.groups, "names": self.names,
                "host": self.host, "pods": self.pods,
                "traffic": self.network.traffic if self.network else object(), "mesh": self.mesh,
                "templates": TemplateApi(self.pods.templates if self.pods else None)}

    def bootstrap(self, bridge: CapnpThread) -> Any:
        pod, vol, net, host, api, template = (
            _schema.pod(),
            _schema.volume(),
            _schema.network(),
            _schema.host(),
            _schema.api(),
            _schema.template(),
        )
        interfaces = {
            "volumes": vol.VolumeService, "securityGroups": net.SecurityGroupService,
            "names": net.NameService, "host": host.HostService, "pods": pod.PodService,
            "traffic": net.TrafficService, "mesh": net.MeshService,
            "templates": template.TemplateService,
        }
        services = {name: Cap(interfaces[name], impl) for name, impl in self.services().items()}

        class Root:
            pass

        root = Root()
        for name, cap in services.items():

            async def get(params: dict[str, Any], cap: Cap = cap) -> dict[str, Any]:
                return {"service": cap}

            setattr(root, snake(name), get)
        return lambda: serve_interface(api.Feos, root, bridge)

    def load(self) -> None:
        self.volumes.load()
        self.groups.load()
        self.names.load()

    def bind(self, inherited: dict[str, socket.socket]) -> None:
        api = inherited.pop("api") if "api" in inherited else bind_unix(self.run_dir / "api.sock")
        self.listeners["api"] = api
        if self.args.tcp is not None:
            tcp = inherited.pop("tcp") if "tcp" in inherited else bind_tcp(*self.args.tcp_address)
            self.listeners["tcp"] = tcp
        for sock in inherited.values():
            sock.close()
        # Copies of the listeners for a self-upgrade's exec: asyncio closes its own at the stop.
        # (from fd 10 on: a self-upgrade puts the resolver's sockets at 3 and 4)
        self.handover = {name: fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
                         for name, sock in self.listeners.items()}

    async def serve(self, inherited: dict[str, socket.socket]) -> None:
        lock_fd = await take_lock(self.state_dir / "feosd.lock")
        set_subreaper()
        # --vmm firecracker is probed before feosd serves: it refuses to start where Firecracker
        # cannot run. auto and qemu serve at once, the probe going on (MicroVms.run).
        vmm = await choose_vmm(self.args.vmm, self.state_dir) \
            if self.args.vmm == "firecracker" else None
        tls = None if self.args.tcp is None else tcp_tls(self.args, self.node_dir)
        self.load()
        staged = None
        async with capnp_thread() as bridge, trio.open_nursery() as nursery:
            await nursery.start(REAPER.run)  # the orphans re-parented to feosd (_reaper)
            cgroups = await trio.to_thread.run_sync(vms_cgroups, self.args.vms_cgroup)
            # the guest links wait until the API serves (open_links below): a restart with pods
            # serves as soon as one without, the links re-attach after it
            self.vms = MicroVms(self.state_dir, self.run_dir, bridge, network=self.guest_network,
                                cgroups=cgroups, choice=vmm, vmm=self.args.vmm,
                                hold_links=True)
            await nursery.start(self.vms.run)
            wait = DISKD_WAIT_S if self.args.disk_wait is None else self.args.disk_wait
            self.diskd = Diskd(self.args.disk_socket or self.state_dir / "disk" / "diskd.sock",
                               bridge, wait_s=wait)
            if not await self.diskd.answers():
                log.warning("no diskd answers at %s: a pod that needs a disk waits for it up to "
                            "%gs, then fails", self.diskd.path, wait)
            self.pods = PodService(self.state_dir, self.vms, self.volumes, groups=self.groups,
                                   tables=self.names, bridge=bridge, diskd=self.diskd,
                                   warm_templates=tuple(self.args.warm_templates),
                                   templates_on_first_use=self.args.templates_on_first_use)
            self.volumes.disks = self.pods.disks
            self.pods.load()
            self.network = Network(self.args.network, self.state_dir, self.pods, self.groups,
                                   self.names, dns_sockets=self.dns_sockets,
                                   mesh=self.mesh if isinstance(self.mesh, Mesh) else None)
            await nursery.start(self.network.run)
            self.pods.attach_network(self.network)
            await nursery.start(self.pods.run)
            self.bind(inherited)
            bootstrap = self.bootstrap(bridge)
            servers = [await bridge.call(listen, sock, bootstrap,
                                         tls.listening if tls and name == "tcp" else None)
                       for name, sock in self.listeners.items()]
            log.info("serving the API on %s", ", ".join(
                _where(sock) + (" (TLS)" if tls and name == "tcp" else "")
                for name, sock in self.listeners.items()))
            if self.args.web is not None:
                await nursery.start(self.serve_web, bridge)
            notify("READY=1")
            self.vms.open_links()
            if self.args.control_plane:
                await self.start_link(nursery, bridge)
            nursery.start_soon(self.resume_then_link)
            staged = await self._wait_for_end()
            await self._stop_pods(suspend=staged is None and self.args.suspend_on_stop,
                                  upgrade=staged is not None)
            log.debug("the stop: the pods' changes have ended")
            self.pods.events.close()  # watchers hear the end of their streams
            await bridge.call(close_listeners, servers)
            log.debug("the stop: the listeners are closed")
            await self.diskd.close()
            log.debug("the stop: diskd's connection is closed; the services are cancelled")
            nursery.cancel_scope.cancel()
        log.debug("the stop: the services and the Cap'n Proto thread have ended")
        if staged is not None:
            self.exec_upgrade(staged, lock_fd)

    async def start_link(self, nursery: trio.Nursery, bridge: CapnpThread) -> None:
        """The control-plane link, on a thread of its own: it holds nothing of feosd up."""
        from .fleet import EventBuffer, LinkConfig, Runtime, make_link

        args = self.args
        node_dir = self.node_dir
        cfg = LinkConfig(control_plane=args.control_plane, server_name=args.control_plane_name,
                         trust_domain=args.trust_domain, token_file=args.join_token_file,
                         node_dir=node_dir, name=socket.gethostname(), mesh_port=args.mesh_port,
                         mesh_address=args.mesh_address,
                         pod_prefix=args.network.pod_prefix is not None)
        runtime = Runtime(pods=self.pods, host=self.host, events=EventBuffer(),
                          mesh_dir=node_dir / "mesh",
                          take_mesh=self.network.take_mesh if self.network else None)
        await nursery.start(runtime.run)
        self.link = make_link(cfg, runtime, self.services(), trio.lowlevel.current_trio_token(),
                              bridge=bridge)
        self.link.start()
        log.info("the control plane: %s (checked for %s)", cfg.control_plane, cfg.server_name)

    async def resume_then_link(self) -> None:
        """The suspend-on-stop's resumes first: the link connects once they are done."""
        assert self.pods is not None
        try:
            await self.stop_record.resume(self.pods)
        finally:
            if self.link is not None:
                self.link.resumes_done()

    async def _stop_pods(self, *, suspend: bool, upgrade: bool = False) -> None:
        """The pods' part of a stop: every new change refused (UNAVAILABLE "feosd stops"), the
        control plane told and the node connections closed (Stopping), the running pods
        suspended if asked, the changes in flight left to end within --stop-grace (less a margin
        for what comes after), and only then the ones left cancelled."""
        assert self.pods is not None
        self.pods.refuse_changes()
        grace = self.args.stop_grace
        end = trio.current_time() + grace - min(STOP_MARGIN_S, grace / 10)
        if self.link is not None:
            await self.link.stop(grace, "upgrading" if upgrade else "stopping")
        # A second SIGTERM or SIGINT meanwhile is taken (and left unread): the stop goes on, rather
        # than Python's default ending feosd in the middle of the changes it waits for.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT):
            if suspend:
                with trio.move_on_after(max(1.0, grace - 10)):
                    await self.pods.hibernations_done()  # a hibernated pod needs no suspend
                    await self.stop_record.suspend_all(self.pods)
            await self.pods.finish_changes(max(0.0, end - trio.current_time()))

    async def serve_web(self, bridge: CapnpThread, *, task_status: Any) -> None:
        """The web console (feos.web) over the same service objects as the API's bootstrap."""
        from .web import Api, serve_console

        services = {"pods": self.pods, "volumes": self.volumes, "securityGroups": self.groups,
                    "names": self.names, "mesh": self.mesh}
        api = Api(services, bridge, vms=self.vms)
        await serve_console(api, self.state_dir, self.args.web_address, task_status=task_status)

    async def guest_network(self, vm_id: str) -> Any:
        return await self.pods.guest_network(vm_id) if self.pods is not None else None

    async def _wait_for_end(self) -> Path | None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                outcome: list[Path | None] = []

                async def on_signal() -> None:
                    async for signum in signals:
                        log.info("%s: stopping", signal.Signals(signum).name)
                        outcome.append(None)
                        nursery.cancel_scope.cancel()
                        return

                async def on_upgrade() -> None:
                    staged = await self._upgrade_receive.receive()
                    await trio.sleep(0.2)  # the call's answer goes out first
                    outcome.append(staged)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                nursery.start_soon(on_upgrade)
        return outcome[0] if outcome else None

    def exec_upgrade(self, staged: Path, lock_fd: int) -> None:
        binary = own_binary()
        replace_binary(staged, binary)
        handed = []
        for name, fd in self.handover.items():
            os.set_inheritable(fd, True)
            handed.append(f"{name}:{fd}")
        env = dict(os.environ, **{LISTEN_VARIABLE: ",".join(handed)})
        if self.network is not None and self.network.dns_sockets is not None:
            env.update(prepare_exec(self.network.dns_sockets))
        log.warning("upgrading: executing %s with the same pid", binary)
        logging.shutdown()
        os.close(lock_fd)  # close-on-exec anyway; the new program takes it again
        os.execve(str(binary), [str(binary), *sys.argv[1:]], env)

    def close(self) -> None:
        if self.pods is not None:
            self.pods.close()
        self.volumes.close()
        self.groups.close()
        self.names.close()


def _where(sock: socket.socket) -> str:
    name = sock.getsockname()
    return name if isinstance(name, str) else f"{name[0]}:{name[1]}"


def vms_cgroups(given: str | None = None) -> Any:
    """The microVMs' cgroup layout (vms/<id> below --vms-cgroup, else below feosd's cgroup),
    prepared; None without one. With --vms-cgroup, the microVMs a feosd from before it left
    below its unit's cgroup are handed over first."""
    from .vmm import detect_cgroups, in_container, prepare_cgroups

    if given is not None:
        try:
            hand_over_vms(given)
        except (OSError, FeosError) as exc:
            log.warning("the microVMs below feosd's own cgroup stay there: %s", exc)
    elif in_container():
        log.info("in a container (a cgroup namespace of its own): feosd moves into feosd/ of the "
                 "container's cgroup, and the microVMs, beside it, end with the container")
    try:
        layout = detect_cgroups(vms_cgroup=given)
        prepare_cgroups(layout)
    except (OSError, FeosError) as exc:
        log.warning("the microVMs get no cgroups of their own: %s", exc)
        return None
    log.info("the microVMs' cgroups: %s", layout)
    return layout


def hand_over_vms(given: str) -> list[str]:
    """Move the microVMs below this process's unit's cgroup into `given` (--vms-cgroup)."""
    from .vmm import detect_cgroups, hand_over_cgroups, own_cgroup, unit_cgroup

    old = detect_cgroups(vms_cgroup=unit_cgroup(own_cgroup()))
    moved = hand_over_cgroups(old, detect_cgroups(vms_cgroup=given))
    if moved:
        log.info("handed %d microVMs over to %s: %s", len(moved), given, ", ".join(moved))
    return moved


def set_subreaper() -> None:
    """Become the subreaper of feosd's descendants; `REAPER` reaps the orphans this brings."""
    try:
        native.set_child_subreaper()
    except OSError as exc:
        log.warning("cannot become the subreaper of feosd's children: %s", exc)


TEST_HOOKS = "FEOSD_TEST_HOOKS"


def install_test_hooks(run_dir: Path) -> None:
    """With FEOSD_TEST_HOOKS=1 only, for tests: SIGUSR2 blocks feosd's trio thread for the
    seconds in <run-dir>/test-block-seconds (a stalled runtime, as on a blocking unlink), so
    that the tests see the control-plane link go on without it (docs/control-plane.md)."""
    if os.environ.get(TEST_HOOKS) != "1":
        return
    import time

    def block(signum: int, frame: object) -> None:
        seconds = float((run_dir / "test-block-seconds").read_text())
        log.warning("test hook: feosd's trio thread blocks for %.0f s", seconds)
        time.sleep(seconds)
        log.warning("test hook: feosd's trio thread moves again")

    signal.signal(signal.SIGUSR2, block)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s feosd %(levelname)s %(name)s: %(message)s",
    )
    if os.getpid() == 1:
        sys.exit("feosd: refusing to run as PID 1 (run it under systemd or feos-host-init)")
    if args.hand_over_vms:
        try:
            hand_over_vms(args.vms_cgroup)
        except (OSError, FeosError) as exc:
            sys.exit(f"feosd: --hand-over-vms: {exc}")
        return
    install_test_hooks(args.run_dir)
    inherited = inherited_listeners(os.environ)  # type: ignore[arg-type]
    # Before any thread starts: the resolver's sockets handed over (systemd, a self-upgrade).
    dns = take_dns_sockets(args.network.dns_address)
    daemon = Daemon(args, dns)
    try:
        trio.run(daemon.serve, inherited)
        log.debug("the stop: trio's run has ended")
    except KeyboardInterrupt:
        pass
    except FeosError as exc:  # a start refused before serving: one line, no traceback
        sys.exit(f"feosd: {exc.message}")
    finally:
        daemon.close()
        log.debug("the stop: the records are closed")
