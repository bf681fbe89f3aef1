"""feosd's API on TCP over TLS 1.3 with client certificates: who is served, who is refused, when.

A real feosd process on loopback with an operator's CA made by trustme, driven by feosctl and by
plain ssl sockets; the control plane's bundle comes from a real join to the test control plane
(tests/controlplane.py). No microVM boots.
"""

from __future__ import annotations

import datetime
import re
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric import ec
from feosd_proc import BIN, Feosd

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from controlplane import ControlPlane
from controlplane_ca import key_pem, make_leaf, pem

UNAUTHENTICATED, UNAVAILABLE = 10 + 16, 10 + 14
PAST = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Pki:
    """The operator's CA (clients and feosd's certificate), another CA, and their files."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.ca, self.other = trustme.CA(), trustme.CA()
        self.write("ca.pem", self.ca.cert_pem.bytes())
        self.write("other-ca.pem", self.other.cert_pem.bytes())
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.write("server.pem", server.cert_chain_pems[0].bytes())
        self.write("server.key", server.private_key_pem.bytes())
        self.client("operator", self.ca.issue_cert("operator@example.com"))
        self.client("stranger", self.other.issue_cert("operator@example.com"))
        self.client("expired", self.ca.issue_cert("operator@example.com", not_after=PAST))

    def write(self, name: str, data: bytes) -> Path:
        (self.root / name).write_bytes(data)
        return self.root / name

    def client(self, name: str, cert: trustme.LeafCert) -> None:
        self.write(f"{name}.pem", b"".join(p.bytes() for p in cert.cert_chain_pems)
                   + cert.private_key_pem.bytes())

    def path(self, name: str) -> str:
        return str(self.root / name)


def ctl(address: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "feosctl"), "--socket", address, *argv],
                          capture_output=True, text=True, timeout=60)


def wait_for_log(daemon: Feosd, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in daemon.log_text():
        assert time.monotonic() < deadline, f"{text!r} not in feosd's log:\n{daemon.log_text()}"
        time.sleep(0.05)
    return daemon.log_text()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[tuple[Feosd, str]]:
    """feosd serving TCP with TLS: the operator's CA for clients, a certificate it issued."""
    port = free_port()
    daemon = Feosd(tmp_path_factory.mktemp("tls") / "node", "--tcp", f"127.0.0.1:{port}",
                   "--tcp-client-ca", pki.path("ca.pem"), "--tcp-cert", pki.path("server.pem"),
                   "--tcp-key", pki.path("server.key"))
    with daemon.start():
        yield daemon, f"127.0.0.1:{port}"


def as_operator(pki: Pki, client: str = "operator") -> list[str]:
    return ["--tls-cert", pki.path(f"{client}.pem"), "--tls-ca", pki.path("ca.pem")]


def test_the_operators_client_is_served(node: tuple[Feosd, str], pki: Pki) -> None:
    daemon, address = node
    done = ctl(address, *as_operator(pki), "--json", "host", "info")
    assert done.returncode == 0, done.stderr
    assert f"{address} (TLS)" in daemon.log_text()


@pytest.mark.parametrize(("client", "reason"), [
    (None, "no client certificate"),
    ("stranger", "unable to get local issuer certificate"),
    ("expired", "certificate has expired"),
])
def test_refused_in_the_handshake_before_any_call(node: tuple[Feosd, str], pki: Pki,
                                                  client: str | None, reason: str) -> None:
    daemon, address = node
    host, port = address.rsplit(":", 1)
    before = daemon.log_text().count("refused a client in the TLS handshake")
    ctx = ssl.create_default_context(cafile=pki.path("ca.pem"))
    if client is not None:
        ctx.load_cert_chain(pki.path(f"{client}.pem"))
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            # TLS 1.3: the client's side of the handshake ends before the server checks it; the
            # server closes without a byte of Cap'n Proto, whatever the client sends.
            tls.sendall(b"\x00" * 64)
            try:
                answer = tls.recv(1024)
            except (ssl.SSLError, ConnectionError):
                answer = b""
            assert answer == b""
    log = wait_for_log(daemon, f"refused a client in the TLS handshake: {reason}")
    assert log.count("refused a client in the TLS handshake") == before + 1

    # A change asked by that client is not made: the refusal comes before any call.
    volume = str(uuid.uuid4())
    if client is None:
        done = ctl(address, "volume", "create", volume, "--size", "64MiB")
        assert done.returncode == UNAVAILABLE, done.stderr
        assert "drops a client without it: --tls-cert" in done.stderr
    else:
        done = ctl(address, *as_operator(pki, client), "volume", "create", volume,
                   "--size", "64MiB")
        assert done.returncode == UNAUTHENTICATED, done.stderr
        assert f"feosd at {address} refused this client in the TLS handshake" in done.stderr
    assert volume not in daemon.ctl("volume", "list").stdout


def test_feosctl_refuses_a_feosd_its_ca_did_not_issue(node: tuple[Feosd, str], pki: Pki) -> None:
    _, address = node
    done = ctl(address, "--tls-cert", pki.path("operator.pem"), "--tls-ca",
               pki.path("other-ca.pem"), "host", "info")
    assert done.returncode == UNAVAILABLE
    assert f"feosd at {address} failed the TLS handshake: " in done.stderr
    assert "certificate" in done.stderr.split("handshake: ")[1]


def test_feosds_own_certificate_is_checked_by_its_pin(tmp_path: Path, pki: Pki) -> None:
    address = f"127.0.0.1:{free_port()}"
    with Feosd(tmp_path / "node", "--tcp", address, "--tcp-client-ca",
               pki.path("ca.pem")).start() as daemon:
        log = wait_for_log(daemon, "feosd's own certificate")
        match = re.search(r"own certificate (\S+), pin (\S+) ", log)
        assert match is not None, log
        assert Path(match[1]) == daemon.state_dir / "tls" / "cert.pem"
        assert (daemon.state_dir / "tls" / "key.pem").stat().st_mode & 0o077 == 0
        pinned = ["--tls-cert", pki.path("operator.pem"), "--tls-pin", match[2]]
        done = ctl(address, *pinned, "host", "info")
        assert done.returncode == 0, done.stderr
        wrong = ctl(address, *pinned[:3], "A" * 43, "host", "info")
        assert wrong.returncode == UNAVAILABLE
        assert f"feosd's key has the pin {match[2]}, not the --tls-pin {'A' * 43}" in wrong.stderr


def cp_client(cp: ControlPlane, directory: Path, name: str, uri: str) -> Path:
    """A client certificate the control plane's CA issued, for the SPIFFE ID `uri`."""
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = make_leaf(cp.ca.ca, cp.ca.ca_key, key.public_key(), dns=[], uris=[uri], server=False,
                     cn=name)
    path = directory / f"{name}.pem"
    path.write_text(pem(leaf, cp.ca.ca) + key_pem(key).decode())
    return path


def test_the_control_planes_bundle_is_trusted_once_joined(
        tmp_path: Path, pki: Pki, node: tuple[Feosd, str]) -> None:
    with ControlPlane(tmp_path / "cp") as cp:
        ferun = cp_client(cp, tmp_path, "ferun", "spiffe://feos.local/ferun")
        other_node = cp_client(cp, tmp_path, "node2", "spiffe://feos.local/node/node2")
        _, unjoined = node
        before = ctl(unjoined, "--tls-cert", str(ferun), "--tls-ca", pki.path("ca.pem"),
                     "host", "info")
        assert before.returncode == UNAUTHENTICATED, before.stderr

        token = tmp_path / "join-token"
        token.write_text(cp.token() + "\n")
        joined, address = tls_node(tmp_path / "node", pki, "--control-plane", cp.address,
                                   "--control-plane-name", cp.ca.server_name,
                                   "--join-token-file", str(token))
        with joined.start():
            cp.wait_for(lambda: cp.joins, why="a join")
            bundle = joined.state_dir / "node" / "bundle.pem"
            deadline = time.monotonic() + 10
            while not bundle.exists():
                assert time.monotonic() < deadline, "no bundle.pem after the join"
                time.sleep(0.05)
            done = ctl(address, "--tls-cert", str(ferun), "--tls-ca", pki.path("ca.pem"),
                       "host", "info")
            assert done.returncode == 0, done.stderr
            assert "the control plane's bundle trusted" in joined.log_text()
            # The operator's clients stay served beside the control plane's.
            assert ctl(address, *as_operator(pki), "host", "info").returncode == 0
            # Another node's certificate, from the same CA, is refused in the handshake.
            refused = ctl(address, "--tls-cert", str(other_node), "--tls-ca", pki.path("ca.pem"),
                          "host", "info")
            assert refused.returncode == UNAUTHENTICATED, refused.stderr
            wait_for_log(joined, "refused a client in the TLS handshake: a node's certificate "
                         "(spiffe://feos.local/node/node2): nodes do not call each other's API")


def test_a_replaced_ca_file_is_used_from_the_next_connection(tmp_path: Path, pki: Pki) -> None:
    ca_file = tmp_path / "client-ca.pem"
    ca_file.write_bytes((pki.root / "ca.pem").read_bytes())
    address = f"127.0.0.1:{free_port()}"
    with Feosd(tmp_path / "node", "--tcp", address, "--tcp-client-ca", str(ca_file), "--tcp-cert",
               pki.path("server.pem"), "--tcp-key", pki.path("server.key")).start() as daemon:
        assert ctl(address, *as_operator(pki), "host", "info").returncode == 0
        stranger = as_operator(pki, "stranger")
        assert ctl(address, *stranger, "host", "info").returncode == UNAUTHENTICATED
        new = tmp_path / "client-ca.pem.new"  # the operator's rotation: written whole, renamed
        new.write_bytes((pki.root / "other-ca.pem").read_bytes())
        new.rename(ca_file)
        done = ctl(address, *stranger, "host", "info")
        assert done.returncode == 0, done.stderr
        assert ctl(address, *as_operator(pki), "host", "info").returncode == UNAUTHENTICATED
        assert "the API's TLS files changed: new connections use them" in daemon.log_text()
        ca_file.write_text("not a certificate\n")  # a bad file: the previous ones stay
        assert ctl(address, *stranger, "host", "info").returncode == 0
        assert f"--tcp-client-ca {ca_file}: " in daemon.log_text()


@pytest.mark.parametrize("extra", [[], ["--tcp-insecure"]])
def test_a_plain_tcp_warns(tmp_path: Path, extra: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    with Feosd(tmp_path / "node", "--tcp", address, *extra).start() as daemon:
        assert ctl(address, "host", "info").returncode == 0
        where = "this machine"  # loopback, with --tcp-insecure or without
        assert (f"the API on TCP {address} is plain, without authentication: anyone on {where}"
                in daemon.log_text())


@pytest.mark.parametrize(("argv", "error"), [
    (["--tcp", "[::]:1337"], "--tcp [::]:1337: not a loopback address: needs --tcp-client-ca "
     "FILE (TLS with client certificates) or --tcp-insecure"),
    (["--tcp", "0.0.0.0:1337", "--tcp-cert", "c.pem", "--tcp-key", "k.pem"],
     "--tcp-cert: needs --tcp-client-ca"),
    (["--tcp-client-ca", "ca.pem"], "--tcp-client-ca: needs --tcp"),
])
def test_a_tcp_that_is_not_safe_is_refused_at_the_start(argv: list[str], error: str) -> None:
    done = subprocess.run([str(BIN / "feosd"), *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"feosd: error: {error}" in done.stderr


def test_a_bad_tls_file_is_refused_at_the_start(tmp_path: Path, pki: Pki) -> None:
    (tmp_path / "empty.pem").write_text("")
    missing, empty, ca = tmp_path / "missing.pem", tmp_path / "empty.pem", pki.path("ca.pem")
    key, wrong_key = pki.path("server.key"), pki.path("stranger.pem")
    for extra, line in (
        (["--tcp-client-ca", str(missing), "--tcp-key", key],
         f"feosd: --tcp-client-ca {missing}: No such file or directory"),
        (["--tcp-client-ca", str(empty), "--tcp-key", key], f"feosd: --tcp-client-ca {empty}: "),
        (["--tcp-client-ca", ca, "--tcp-key", wrong_key],
         f"feosd: --tcp-cert/--tcp-key {pki.path('server.pem')}: key values mismatch"),
    ):
        daemon = Feosd(tmp_path / "node", "--tcp", f"127.0.0.1:{free_port()}",
                       "--tcp-cert", pki.path("server.pem"), *extra)
        proc = daemon.spawn()
        assert proc.wait(30) == 1
        last = daemon.log_text().strip().splitlines()[-1]
        assert last.startswith(line), daemon.log_text()


def tls_node(root: Path, pki: Pki, *extra: str) -> tuple[Feosd, str]:
    address = f"127.0.0.1:{free_port()}"
    return Feosd(root, "--tcp", address, "--tcp-client-ca", pki.path("ca.pem"), "--tcp-cert",
                 pki.path("server.pem"), "--tcp-key", pki.path("server.key"), *extra), address


def test_host_reboot_and_shutdown_over_tls(tmp_path: Path, pki: Pki) -> None:
    """The calls reach HostService over TLS (in a PID namespace it refuses to signal the
    namespace's init, which is how a test sees them answered without a reboot); a stranger's
    never arrive. The reboot itself is feos-host-init's (its image's tests)."""
    daemon, address = tls_node(tmp_path / "node", pki)
    with daemon.start(prefix=["unshare", "--pid", "--fork", "--kill-child",
                              "sh", "-c", '"$@" & wait $!', "sh"]):
        for verb in ("reboot", "shutdown"):
            done = ctl(address, *as_operator(pki), "host", verb)
            assert done.returncode == 19, done.stderr
            assert "PID namespace of its own" in done.stderr
            refused = ctl(address, *as_operator(pki, "stranger"), "host", verb)
            assert refused.returncode == UNAUTHENTICATED, refused.stderr
        assert daemon.log_text().count("signalling PID 1") == 0


def test_an_upgrade_over_tls_serves_tls_again(tmp_path: Path, pki: Pki) -> None:
    program = tmp_path / "bin" / "feosd"
    program.parent.mkdir()
    original = (BIN / "feosd").read_text()
    program.write_text(original)
    program.chmod(0o755)
    daemon, address = tls_node(tmp_path / "node", pki, "--self-upgrade")
    daemon.program = [str(program)]
    with daemon.start():
        pid = daemon.proc.pid  # type: ignore[union-attr]
        before = ctl(address, *as_operator(pki), "--json", "host", "info")
        assert before.returncode == 0, before.stderr
        new = tmp_path / "feosd-new"
        new.write_text(original + "\n# upgraded\n")
        done = ctl(address, *as_operator(pki), "host", "upgrade", str(new))
        assert done.returncode == 0, done.stderr
        wait_for_log(daemon, "upgrading: executing", timeout=20)
        deadline = time.monotonic() + 20
        while daemon.log_text().count("(TLS)") < 2:  # the new program's "serving the API on"
            assert time.monotonic() < deadline, daemon.log_text()
            time.sleep(0.1)
        after = ctl(address, *as_operator(pki), "--json", "host", "info")
        assert after.returncode == 0, after.stderr
        assert f'"pid": {pid}' in after.stdout and after.stdout != before.stdout
        assert ctl(address, "host", "info").returncode == UNAVAILABLE  # plain: still refused
        refused = ctl(address, *as_operator(pki, "expired"), "host", "info")
        assert refused.returncode == UNAUTHENTICATED
