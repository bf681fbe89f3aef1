"""What test_network_pods.py adds to podnet.PodNet: servers on the "internet", the records that
`feosctl traffic watch` prints as they come, and the requests a pod makes from inside.

Not a test file. podnet.PodNet is used as it is; nothing here changes it:

- `Internet` puts two addresses on the internet namespace's loopback, one open (198.51.100.80)
  and one in a prefix feosd is told to deny (203.0.113.7, of --deny-prefix 203.0.113.0/24), and
  serves HTTP on both from one Python http.server there, whose log names who connected.
- `TrafficWatch` runs `feosctl --json traffic watch` for the module's whole session and keeps
  every record it printed; `wait_for(match)` waits until one matches.
- `in_pod_*` are what a user types into `feosctl pod exec`: busybox wget and nc (the image has
  nothing else), with nc standing in for an HTTP client where busybox wget cannot (a PUT).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _owner import OWNER, end_group
from podnet import PodNet, sh

INTERNET_V4 = "198.51.100.80"
DENY_PREFIX = "203.0.113.0/24"
DENIED_V4 = "203.0.113.7"
INTERNET_PORT = 8081
POD_PORT = 8080
METADATA = "169.254.169.254"
Record = dict[str, Any]


class Internet:
    """An HTTP server in the internet namespace on an open and on a denied address."""

    def __init__(self, net: PodNet, root: Path) -> None:
        self.net = net
        self.root = root
        self.log = root / "internet-http.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Internet:
        for address in (INTERNET_V4, DENIED_V4):
            sh("ip", "-n", self.net.inet_ns, "addr", "add", f"{address}/32", "dev", "lo")
        site = self.root / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "index.html").write_text("hello from the internet\n")
        with open(self.log, "ab") as log:
            self.proc = OWNER.popen(
                self.net.in_inet(sys.executable, "-u", "-m", "http.server", "--bind", "0.0.0.0",
                                 "--directory", str(site), str(INTERNET_PORT)),
                stdout=log, stderr=subprocess.STDOUT)
        for address in (INTERNET_V4, DENIED_V4):
            self._wait(address)
        return self

    def _wait(self, address: str) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.node_reaches(address, in_ns=self.net.inet_ns):
                return
            time.sleep(0.1)
        raise AssertionError(f"the internet's server does not answer on {address}")

    def node_reaches(self, address: str, in_ns: str | None = None) -> bool:
        """Whether a TCP connect to the server from the node (or `in_ns`) succeeds within 3 s."""
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3)"
        ns = in_ns or self.net.node_ns
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe, address,
                               str(INTERNET_PORT)], capture_output=True, timeout=30)
        return done.returncode == 0

    def clients(self) -> list[str]:
        """The source addresses of the requests the server logged."""
        return [line.split()[0] for line in self.log.read_text().splitlines()
                if '"GET ' in line]

    def close(self) -> None:
        if self.proc is not None:
            end_group(self.proc)
            OWNER.forget(self.proc)


class TrafficWatch:
    """`feosctl --json traffic watch` in the background; every record it printed, kept."""

    def __init__(self, net: PodNet) -> None:
        self.records: list[Record] = []
        self._changed = threading.Condition()
        self.proc = net.ctl_popen("--json", "traffic", "watch")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.records.append(json.loads(line))
                self._changed.notify_all()

    def wait_for(self, match: Callable[[Record], bool], what: str,
                 timeout: float = 30) -> Record:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((r for r in self.records if match(r)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no traffic record of {what} within {timeout}s "
                                         f"(watch exit {self.proc.poll()}); records: "
                                         f"{json.dumps(self.records[-20:])}")
                self._changed.wait(left)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


# -- what a user sends feosd ------------------------------------------------------------------


def rule(protocol: str, peer: dict[str, Any], port: int | None = None) -> dict[str, Any]:
    """A security group's rule; `peer` is {"group": ID} or {"block": {"cidr": ...}}."""
    ports = {"firstPort": port, "lastPort": port} if port else {}
    return {"protocol": protocol, "peer": peer, **ports}


def block(cidr: str) -> dict[str, Any]:
    return {"block": {"cidr": cidr}}


INTERNET_RULES = [rule("any", block("0.0.0.0/0")), rule("any", block("::/0"))]


def pod_spec(image: str, command: list[str], *, groups: Sequence[str] = (),
             names: Sequence[str] = (), metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "vcpus": 1, "memoryMib": 256,
        "containers": [{"name": "main", "image": image, "command": command}],
        "network": {"pod": {"securityGroups": list(groups), "nameTables": list(names)}},
        "metadataJson": json.dumps(metadata) if metadata is not None else "",
    }


def create_pods(net: PodNet, specs: dict[str, dict[str, Any]], timeout: float = 300,
                ) -> dict[str, Any]:
    """`feosctl --json pod create ID -f SPEC --wait` for every pod at once; their PodInfos."""
    waits = {pod_id: net.ctl_popen("--json", "pod", "create", pod_id, "-f",
                                   net.spec_file(pod_id, spec), "--wait")
             for pod_id, spec in specs.items()}
    pods = {}
    for pod_id, wait in waits.items():
        out, err = wait.communicate(timeout=timeout)
        assert wait.returncode == 0, f"pod create {pod_id}: {err}"
        pods[pod_id] = json.loads(out)
    return pods


# -- what a user runs in a pod ----------------------------------------------------------------


def server_command(text: str) -> list[str]:
    """A container that serves `text` over HTTP on POD_PORT, of both families (busybox httpd)."""
    return ["/bin/sh", "-c", f"busybox mkdir -p /www && echo {text} > /www/index.html && "
                             f"exec busybox httpd -f -p {POD_PORT} -h /www"]


def url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}/"


def in_pod_get(net: PodNet, pod_id: str, address: str, port: int = POD_PORT) -> str:
    """What busybox wget in the pod gets from address:port (fails the test if it gets nothing)."""
    return net.exec(pod_id, "busybox", "wget", "-q", "-O-", url(address, port)).stdout


def in_pod_connect(net: PodNet, pod_id: str, address: str, port: int = POD_PORT,
                   wait: int = 1) -> str:
    """busybox nc's TCP connect from the pod to address:port: "connected", or what nc said
    (such as "nc: timed out" when the SYN was dropped, or a refusal)."""
    done = net.exec(pod_id, "busybox", "nc", "-w", str(wait), address, str(port),
                    "-e", "/bin/true", check=False)
    return "connected" if done.returncode == 0 else done.stderr.strip()


def in_pod_http(net: PodNet, pod_id: str, method: str, host: str, path: str,
                headers: dict[str, str]) -> tuple[int, str]:
    """A raw HTTP/1.1 request written with printf into busybox nc: (status, body)."""
    head = "".join(f"{k}: {v}\\r\\n" for k, v in {"Host": host, **headers,
                                                  "Connection": "close"}.items())
    script = f"printf '{method} {path} HTTP/1.1\\r\\n{head}\\r\\n' | busybox nc -w 5 {host} 80"
    answer = net.exec(pod_id, "sh", "-c", script).stdout  # text: its CRLFs read as LFs
    status_line, _, rest = answer.partition("\n")
    _, _, body = rest.partition("\n\n")
    return int(status_line.split()[1]), body


def metadata_token(net: PodNet, pod_id: str, ttl: int = 60) -> str:
    status, body = in_pod_http(net, pod_id, "PUT", METADATA, "/latest/api/token",
                               {"X-metadata-token-ttl-seconds": str(ttl)})
    assert status == 200 and body.strip(), (status, body)
    return body.strip()


def metadata_get(net: PodNet, pod_id: str, path: str, token: str) -> str:
    """GET path with the token, by busybox wget as a user would."""
    return net.exec(pod_id, "busybox", "wget", "-q", "-O-", "--header", f"X-metadata-token: {token}",
                    f"http://{METADATA}{path}").stdout
