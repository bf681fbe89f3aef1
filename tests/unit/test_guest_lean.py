"""The agent's lean imports (feos.guest._lean) and its signal handlers (feos.guest._proc.on_signal).

The agent's own interpreter is a subprocess started as the image's launcher starts it (python3 -S
-E, the repo alone put on sys.path by hand, after the standard library: no site-packages, as the
image has none), so that nothing the test process imported hides what the agent's import does. HTTPS after the block of ssl is checked
against a real TLS server (trustme's CA, given to OpenSSL by SSL_CERT_FILE).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from feos.guest import _lean, _proc

REPO = Path(__file__).resolve().parents[2]

AGENT = """
import sys
sys.path.append(sys.argv[1])
import feos.guest.__main__  # the agent's imports, as the launcher makes them
from feos.guest import _lean
seen = {"ssl": "ssl" in sys.modules, "pending": _lean.pending(), "gc": __import__("gc").isenabled()}
import http.client
from feos.guest._registry import Client
seen["https"] = hasattr(http.client, "HTTPSConnection")
if len(sys.argv) > 2:
    conn = Client._connection("https", sys.argv[2])
    conn.request("GET", "/v2/")
    resp = conn.getresponse()
    seen["status"] = resp.status
    seen["body"] = resp.read().decode()
import json
print(json.dumps(seen))
"""


def agent_imports(*args: str) -> dict[str, object]:
    env = {**os.environ, **({"SSL_CERT_FILE": args[1]} if len(args) > 1 else {})}
    out = subprocess.run(
        [sys.executable, "-S", "-E", "-c", AGENT, str(REPO), *args[:1]],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_agents_start_imports_no_ssl_and_leaves_the_lazy_modules_waiting() -> None:
    seen = agent_imports()
    assert seen["ssl"] is False
    assert sorted(seen["pending"]) == sorted(_lean.LAZY)  # type: ignore[arg-type]
    assert seen["gc"] is True
    assert seen["https"] is True  # http.client, imported after the block, has HTTPS


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(ctx)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], ca_file
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_registry_client_speaks_https_after_the_lean_start(
    tls_server: tuple[int, Path],
) -> None:
    port, ca_file = tls_server
    seen = agent_imports(f"localhost:{port}", str(ca_file))
    assert seen["ssl"] is False
    assert (seen["status"], seen["body"]) == (200, "{}")


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A module of the test's own, made lazy: its body counts its runs in a file, slowly."""
    name = f"feos_lean_probe_{os.getpid()}"
    count = tmp_path / "runs"
    (tmp_path / f"{name}.py").write_text(
        "import pathlib, time\n"
        f"p = pathlib.Path({str(count)!r})\n"
        "p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else '1')\n"
        "time.sleep(0.2)\n"
        "VALUE = 42\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        _lean._make_lazy(name)
        yield name, count
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def _runs(count: Path) -> int:
    return int(count.read_text()) if count.exists() else 0


def test_a_lazy_module_runs_on_its_first_attribute_not_on_import(
    probe: tuple[str, Path],
) -> None:
    import importlib

    name, count = probe
    importlib.import_module(name)  # what `import name` does: it reads __spec__ alone
    exec(f"import {name}")
    assert _runs(count) == 0
    assert sys.modules[name].VALUE == 42
    assert _runs(count) == 1
    assert type(sys.modules[name]).__name__ == "module"


def test_a_lazy_module_runs_once_when_threads_touch_it_together(
    probe: tuple[str, Path],
) -> None:
    name, count = probe
    module = sys.modules[name]
    values: list[int] = []
    threads = [threading.Thread(target=lambda: values.append(module.VALUE)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert values == [42] * 8
    assert _runs(count) == 1


def test_on_signal_runs_the_callback_on_the_loop_and_can_be_removed() -> None:
    before = signal.getsignal(signal.SIGUSR1)

    async def main() -> list[tuple[str, bool]]:
        loop = asyncio.get_running_loop()
        got: list[tuple[str, bool]] = []
        done = asyncio.Event()

        def callback(word: str) -> None:
            got.append((word, asyncio.get_running_loop() is loop))
            done.set()

        _proc.on_signal(signal.SIGUSR1, callback, "usr1")
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(done.wait(), 5)
        _proc.on_signal(signal.SIGUSR1, None)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        return got

    try:
        assert asyncio.run(main()) == [("usr1", True)]
    finally:
        signal.signal(signal.SIGUSR1, before)
