"""A node for tests of pods with a network: feosd as a user runs it, inside throwaway namespaces.

Not a test file: the integration tests of pods (test_pods_network.py, test_pods_faults.py) and
bench/pods.py import it (with integration/ on sys.path).

    with PodNet(tmp_path, "--suspend-on-stop") as net:   # or net = PodNet(...).start(); net.close()
        net.ctl("pod", "create", "--image", net.image, "--cmd", "sleep", "600", "--wait")

What it makes (every name with a random suffix, so runs side by side do not meet):

- a network namespace "node" where feosd runs (`ip netns exec NODE feosd --state-dir ...
  --run-dir ... --pod-prefix fd00:db8:1::/64 --dns-upstream 198.51.100.53`), with a veth
  `uplink` to
- a namespace "internet" that holds the node's gateways (192.0.2.1, 2001:db8:1::1) and, on its
  loopback, 198.51.100.1 where Debian's docker-registry serves `feos/busybox:1` (the guest
  engineer's image of busybox-static, built here without network by tests/unit/
  test_guest_registry.py's helpers, which are imported, not copied; and `feos/bad-user:1`, whose
  container cannot be made) and 198.51.100.53 where a
  dnsmasq answers `registry.test` as the pods' upstream resolver.

The node's addresses are 192.0.2.2/24 and 2001:db8:1::2/64, its default routes go to the
internet namespace, and the pods' IPv4 leaves masqueraded to 192.0.2.2. The pod prefix is a ULA,
so pods get a route for fc00::/7 rather than a default (the registry is reached over IPv4).
Nothing leaves the two namespaces: feosd reaches nothing else.

`ip netns exec` gives feosd a mount namespace whose /sys is the node namespace's (its TAPs in
/sys/class/net), with no cgroup2 mounted: feosd logs that the microVMs get no cgroups of their
own and runs without. That is deliberate here: on a shared test machine its cgroup setup would
move every process of the test's cgroup (other engineers' too) into a leaf of its own.

The interface (module-scope it: `with PodNet(tmp_path_factory.mktemp(...), *feosd_args) as net`):
- `net.ctl(*argv, check=True)`, `net.ctl_json(*argv)`, `net.ctl_popen(*argv)` (a caller that
  may go away), `net.exec(pod, *command, check=True)`: feosctl against the node's socket;
- `net.wait_state(pod, state)`, `net.qemus()` ({pod: QEMU pid}), `net.links()` (the node
  namespace's link names: `pod-<ID>` TAPs), `net.state_dir`, `net.spec_file(name, spec)`;
- `net.kill_feosd()` (kill -9), `net.stop_feosd()` (SIGTERM; its exit code), `net.start_feosd()`
  (a new feosd on the same directories), `net.feosd` (integration/feosd_proc.Feosd);
- `net.in_node(*argv)`, `net.in_inet(*argv)`: a command line run in either namespace;
- `net.stop_registry()`: the registry ends (nothing can be pulled after it);
- `IMAGE`, `BAD_USER_IMAGE`, `REGISTRY_V4`, `REGISTRY_NAME`, `PREFIX`, `IPV4_RANGE`.

`close()` (also after a failure) kills feosd and every QEMU of its state directory (the
microVMs outlive feosd by design), then every process still in the node namespace, stops the
registry and dnsmasq, and deletes both namespaces (their veth and TAPs go with them).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from _owner import OWNER, end_group, kill_and_wait
from _owner import qemu_pids as qemu_pids
from feosd_proc import BIN, Feosd

REPO = Path(__file__).resolve().parent.parent
PREFIX = "fd00:db8:1::/64"
IPV4_RANGE = "169.254.16.0/20"
NODE_V4, GATEWAY_V4 = "192.0.2.2", "192.0.2.1"
NODE_V6, GATEWAY_V6 = "2001:db8:1::2", "2001:db8:1::1"
REGISTRY_V4 = "198.51.100.1"
RESOLVER_V4 = "198.51.100.53"
REGISTRY_V6 = "2001:db8:ffff::1"  # in DNS only: the pods (a ULA) have no route to it
REGISTRY_PORT = 5000
REGISTRY_NAME = "registry.test"
IMAGE = f"{REGISTRY_V4}:{REGISTRY_PORT}/feos/busybox:1"
# the same busybox whose config names a user its /etc/passwd lacks: its container cannot be made
BAD_USER_IMAGE = f"{REGISTRY_V4}:{REGISTRY_PORT}/feos/bad-user:1"


def sh(*argv: str, check: bool = True, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def install_guest() -> None:
    """The guest image of this tree (built only if its inputs changed; a second is reused)."""
    subprocess.run([str(REPO / "hack/guest-image")], check=True, stdout=subprocess.DEVNULL,
                   timeout=1200)


class PodNet:
    def __init__(self, root: Path, *feosd_args: str, dns: bool = True,
                 pod_prefix: str | None = PREFIX, hostname: str | None = None) -> None:
        """`pod_prefix` None: no --pod-prefix (a node on a mesh); `hostname`: feosd's own
        (a UTS namespace of its own), so that two nodes on this machine have two names."""
        self.root = root
        self.pod_prefix = pod_prefix
        self.wrap = (["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
                     if hostname else [])
        tag = secrets.token_hex(3)
        self.node_ns, self.inet_ns = f"feos-node-{tag}", f"feos-inet-{tag}"
        self.image = IMAGE
        self.dns = dns
        self._procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []
        args = ["--pod-ipv4-range", IPV4_RANGE]
        if pod_prefix is not None:
            args = ["--pod-prefix", pod_prefix, *args]
        if dns:
            args += ["--dns-upstream", RESOLVER_V4]
        self.feosd = Feosd(root / "node", *args, *feosd_args)

    # -- setting up ------------------------------------------------------------------------

    def start(self, *, feosd: bool = True) -> PodNet:
        """Everything; `feosd` False: all but feosd, for a caller that adds to its arguments."""
        try:
            install_guest()
            self._namespaces()
            self._registry()
            if self.dns:
                self._dnsmasq()
            if feosd:
                self.start_feosd()
        except BaseException:
            self.close()
            raise
        return self

    def in_node(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.node_ns, *argv]

    def in_inet(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.inet_ns, *argv]

    def _namespaces(self) -> None:
        for ns in (self.node_ns, self.inet_ns):
            OWNER.netns(ns)
            self._made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        node, inet = ("ip", "-n", self.node_ns), ("ip", "-n", self.inet_ns)
        sh(*node, "link", "add", "uplink", "type", "veth", "peer", "name", "node0",
           "netns", self.inet_ns)
        sh(*node, "addr", "add", f"{NODE_V4}/24", "dev", "uplink")
        sh(*node, "-6", "addr", "add", f"{NODE_V6}/64", "dev", "uplink", "nodad")
        sh(*inet, "addr", "add", f"{GATEWAY_V4}/24", "dev", "node0")
        sh(*inet, "-6", "addr", "add", f"{GATEWAY_V6}/64", "dev", "node0", "nodad")
        for address in (REGISTRY_V4, RESOLVER_V4):
            sh(*inet, "addr", "add", f"{address}/32", "dev", "lo")
        sh(*node, "link", "set", "uplink", "up")
        sh(*inet, "link", "set", "node0", "up")
        sh(*node, "route", "add", "default", "via", GATEWAY_V4)
        sh(*node, "-6", "route", "add", "default", "via", GATEWAY_V6)
        if self.pod_prefix is not None:
            sh(*inet, "-6", "route", "add", self.pod_prefix, "via", NODE_V6)

    def _registry(self) -> None:
        directory = self.root / "registry"
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "config.yml"
        config.write_text(
            "version: 0.1\nlog: {level: error}\n"
            f"storage: {{filesystem: {{rootdirectory: {directory}/storage}}}}\n"
            f"http: {{addr: '{REGISTRY_V4}:{REGISTRY_PORT}'}}\n")
        self._registry_proc = self._spawn(self.in_inet("docker-registry", "serve", str(config)),
                                          "registry.log")
        self._wait_port(REGISTRY_V4, REGISTRY_PORT)
        # The image is pushed from inside the namespace with the guest engineer's helpers.
        push = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from test_guest_registry import busybox_layer, push_busybox, push_image; "
                "print(push_busybox(sys.argv[2])); "
                "push_image(sys.argv[2], 'feos/bad-user', '1', [busybox_layer()], "
                "{'User': 'no-such-user', 'Cmd': ['sleep', '600']})")
        self.image_digest = sh(*self.in_inet(sys.executable, "-c", push,
                                             str(REPO / "tests/unit"),
                                             f"{REGISTRY_V4}:{REGISTRY_PORT}")).strip()

    def stop_registry(self) -> None:
        """End the registry (a test that proves a pod pulls nothing); its data stays."""
        end_group(self._registry_proc)
        OWNER.forget(self._registry_proc)
        self._procs.remove(self._registry_proc)

    def _dnsmasq(self) -> None:
        self._spawn(self.in_inet(
            "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
            "--no-hosts", "--bind-interfaces", f"--listen-address={RESOLVER_V4}",
            "--except-interface=node0", "--pid-file=", "--user=root", "--log-facility=-",
            f"--host-record={REGISTRY_NAME},{REGISTRY_V4},{REGISTRY_V6}"), "dnsmasq.log")
        self._wait_port(RESOLVER_V4, 53)

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.root / log_name, "ab") as log:
            proc = OWNER.popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._procs.append(proc)
        return proc

    def _wait_port(self, host: str, port: int) -> None:
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if subprocess.run(self.in_inet(sys.executable, "-c", probe, host, str(port)),
                              capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"nothing listens on {host}:{port} in {self.inet_ns}")

    # -- feosd ----------------------------------------------------------------------------

    def start_feosd(self, timeout: float = 60) -> Feosd:
        """Start (or start again) feosd in the node namespace and wait until it serves."""
        self.feosd.start(timeout, prefix=["ip", "netns", "exec", self.node_ns, *self.wrap])
        return self.feosd

    def kill_feosd(self) -> None:
        """kill -9: the microVMs go on (a session of their own)."""
        self.feosd.kill()

    def stop_feosd(self, timeout: float = 120) -> int:
        return self.feosd.stop(timeout)

    @property
    def state_dir(self) -> Path:
        return self.feosd.state_dir

    def ctl(self, *argv: str, check: bool = True, timeout: float = 180,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.feosd.ctl(*argv, check=check, timeout=timeout, input=input)

    def ctl_json(self, *argv: str, timeout: float = 180) -> Any:
        return json.loads(self.ctl("--json", *argv, timeout=timeout).stdout)

    def ctl_popen(self, *argv: str) -> subprocess.Popen[str]:
        """feosctl in the background, as a caller that may go away."""
        return subprocess.Popen([str(BIN / "feosctl"), "--socket", str(self.feosd.socket), *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def exec(self, pod_id: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`feosctl pod exec POD -- COMMAND...` in the pod's container main."""
        return self.ctl("pod", "exec", pod_id, "--", *command, check=check)

    def wait_state(self, pod_id: str, want: str, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] = {}
        while time.monotonic() < deadline:
            pod = self.ctl_json("pod", "get", pod_id)
            if pod["state"] == want:
                return pod
            if pod["state"] == "failed" and want != "failed":
                raise AssertionError(f"pod {pod_id} failed: {pod.get('reason')}")
            time.sleep(0.3)
        raise AssertionError(f"pod {pod_id} is {pod.get('state')} ({pod.get('step')}), not {want},"
                             f" after {timeout}s")

    def qemus(self) -> dict[str, int]:
        return qemu_pids(self.state_dir)

    def links(self) -> list[str]:
        """The names of the node namespace's links (the pods' TAPs among them)."""
        out = json.loads(sh("ip", "-n", self.node_ns, "-j", "link", "show"))
        return [link["ifname"] for link in out]

    def spec_file(self, name: str, spec: dict[str, Any]) -> str:
        path = self.root / f"{name}.json"
        path.write_text(json.dumps(spec))
        return str(path)

    # -- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        self.feosd.close()
        for pid in qemu_pids(self.feosd.state_dir).values():
            kill_and_wait(pid)
        if self.node_ns in self._made:
            # whatever feosd left running in its namespace (all of it its children)
            for left in sh("ip", "netns", "pids", self.node_ns, check=False).split():
                kill_and_wait(int(left))
        for proc in self._procs:
            end_group(proc)
            OWNER.forget(proc)
        self._procs.clear()
        for ns in reversed(self._made):
            OWNER.done(ns)
        self._made.clear()

    def __enter__(self) -> PodNet:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

