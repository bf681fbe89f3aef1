"""The main command end to end: `python -m feos.quickstart` (what hack/run runs after the install)
from a fresh directory to the demo pod's page, run again, and stopped with SIGINT.

Where it runs: in a network namespace "node" the test makes (`ip netns exec NODE`), joined by a
veth to a namespace "net" holding its gateways, so the node has an address and default routes as
a machine has, and nothing the pods or feosd send can reach a real network. `ip netns exec` also
gives feosd no cgroup2 mount (see podnet.py: on this shared machine its cgroup setup must not
move other processes). The quickstart makes its registry's namespace itself, as on a real node.

One test, in order (each step needs the one before): the first run prints URLs and every one
answers the demo's page from the node; SIGINT leaves no process in the node namespace and no
registry namespace; the second run finds the prefix, the image and the stopped pod (started
again, not made twice) and answers again; SIGINT again. The teardown kills whatever is left.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from podnet import install_guest, qemu_pids, sh

from feos.quickstart import _registry
from feos.quickstart._demo import POD_ID

NODE_V4, GATEWAY_V4 = "192.0.2.2", "192.0.2.1"
NODE_V6, GATEWAY_V6 = "2001:db8:1::2", "2001:db8:1::1"
PORT = 18080
GET = ("import http.client,sys,urllib.parse as u\n"
       "p=u.urlsplit(sys.argv[1]); c=http.client.HTTPConnection(p.hostname,p.port,timeout=10)\n"
       "c.request('GET',p.path or '/'); r=c.getresponse()\n"
       "print(r.status if sys.argv[2:] else r.read().decode().strip())\n")


class Node:
    def __init__(self, root: Path) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.net_ns = f"feos-qsn-{tag}", f"feos-qsg-{tag}"
        self.dir = root / "local"
        self.reg = _registry.registry_for(self.dir / "quickstart")
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = root / "quickstart.err"

    def make(self) -> None:
        for ns in (self.ns, self.net_ns):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        node, net = ("ip", "-n", self.ns), ("ip", "-n", self.net_ns)
        sh(*node, "link", "add", "eth0", "type", "veth", "peer", "name", "node0",
           "netns", self.net_ns)
        sh(*node, "addr", "add", f"{NODE_V4}/24", "dev", "eth0")
        sh(*node, "-6", "addr", "add", f"{NODE_V6}/64", "dev", "eth0", "nodad")
        sh(*net, "addr", "add", f"{GATEWAY_V4}/24", "dev", "node0")
        sh(*net, "-6", "addr", "add", f"{GATEWAY_V6}/64", "dev", "node0", "nodad")
        for ns, dev in ((node, "eth0"), (net, "node0")):
            sh(*ns, "link", "set", dev, "up")
        sh(*node, "route", "add", "default", "via", GATEWAY_V4)
        sh(*node, "-6", "route", "add", "default", "via", GATEWAY_V6)

    def start(self) -> str:
        """Run the quickstart; its stdout up to the summary's last line."""
        argv = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "feos.quickstart",
                "--dir", str(self.dir), "--port", str(PORT)]
        with open(self.stderr, "a") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
        return self._read_until("Ctrl-C stops it", timeout=900)

    def _read_until(self, marker: str, timeout: float) -> str:
        """The quickstart's stdout until `marker` (os.read: no buffer that select cannot see)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd, out, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while marker.encode() not in out:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                raise AssertionError(f"no {marker!r} (exit {self.proc.poll()}):\n"
                                     f"{out.decode()}\n{self.stderr.read_text()}")
            out += chunk
        return out.decode()

    def interrupt(self) -> str:
        """SIGINT, as Ctrl-C; what it said while stopping."""
        assert self.proc is not None
        before = len(self.stderr.read_text())
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(300) == 0, self.stderr.read_text()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.stderr.read_text()[before:]

    def get(self, url: str, *status: str) -> str:
        """The page at url, fetched in the node namespace (its status with "status")."""
        done = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-c", GET, url,
                               *status],
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or done.stderr.strip().splitlines()[-1]

    def ctl_json(self, *argv: str) -> list[dict[str, object]]:
        import json
        done = sh(str(Path(sys.executable).parent / "feosctl"), "--socket",
                  str(self.dir / "run/api.sock"), "--json", *argv)
        found: list[dict[str, object]] = json.loads(done)
        return found

    def procs(self) -> list[tuple[int, str]]:
        """The processes whose command line names the test's directory (feosd, docker-registry,
        QEMU) or that run in the node namespace: (pid, comm). Found through /proc, because the
        registry's namespace is mounted in the quickstart's mount namespace, not the test's."""
        pids = {int(p) for p in sh("ip", "netns", "pids", self.ns, check=False).split()}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if str(self.dir).encode() in (proc / "cmdline").read_bytes():
                    pids.add(int(proc.name))
            except OSError:
                continue
        pids.discard(os.getpid())
        found = []
        for pid in sorted(pids):
            try:
                found.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
            except OSError:
                continue
        return found

    def left(self) -> list[str]:
        """What is still running, and the registry's namespace if it is still named."""
        names = [comm for _, comm in self.procs()]
        if (Path("/run/netns") / self.reg.namespace).exists():
            names.append(f"namespace {self.reg.namespace}")
        return names

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        for pid in qemu_pids(self.dir / "state").values():
            _kill(pid)
        for pid, _ in self.procs():
            _kill(pid)
        for ns in (self.reg.namespace, self.ns, self.net_ns):
            sh("ip", "netns", "delete", ns, check=False)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    install_guest()
    made = Node(tmp_path)
    try:
        made.make()
        yield made
    finally:
        made.close()


def printed_urls(out: str) -> list[str]:
    return re.findall(r"^\s+(http://\S+)$", out, re.MULTILINE)


def test_the_main_command_serves_the_demo_finds_it_again_and_stops_clean(node: Node) -> None:
    out = node.start()
    urls = printed_urls(out)
    assert urls == [f"http://127.0.0.1:{PORT}/", f"http://[::1]:{PORT}/",
                    f"http://{NODE_V4}:{PORT}/", f"http://[{NODE_V6}]:{PORT}/"], out
    want = f"hello from pod {POD_ID}"
    got = {url: node.get(url) for url in urls}
    assert all(page.startswith(want) for page in got.values()), got
    # the web console, when this feosd has one (feosd --help lists --web)
    for console in re.findall(r"the web console: (http://\S+)$", out, re.MULTILINE):
        assert node.get(console, "status") == "200", console
    assert f"--socket {node.dir / 'run/api.sock'} pod get {POD_ID}" in out
    prefix = (node.dir / "quickstart/prefix").read_text()
    assert re.fullmatch(r"fd[0-9a-f]{2}:[0-9a-f]{1,4}:[0-9a-f]{1,4}::/64\n", prefix), prefix

    said = node.interrupt()
    assert "what stays" in said and f"the pod {POD_ID}, stopped" in said, said
    assert node.left() == [], said

    before = len(node.stderr.read_text())
    out = node.start()
    again = node.stderr.read_text()[before:]
    assert "kept from before" in again and "already in the registry" in again, again
    assert "started again (it was stopped)" in again, again
    assert [p["id"] for p in node.ctl_json("pod", "list")] == [POD_ID]
    running = [comm for _, comm in node.procs()]
    assert running.count("docker-registry") == 1 and running.count("feosd") == 1, running
    assert (node.dir / "quickstart/prefix").read_text() == prefix
    assert printed_urls(out) == urls
    got = {url: node.get(url) for url in urls}
    assert all(page.startswith(want) for page in got.values()), got

    node.interrupt()
    assert node.left() == []
