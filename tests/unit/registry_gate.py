"""A registry's gate for the token rule's tests: it passes GETs on to a registry when they carry
no Authorization (an anonymous pull) or `Bearer GOOD`, answers 401 invalid_token to any other
token (a registry refuses a token it does not accept, even for a public repository), and writes
down each GET's path and whether it carried a token, so that a test can tell a pull that fetched
blobs from one that asked for the manifest only.

Imported by tests/unit/test_templates_held.py; run by integration/test_pods_templates.py inside
its registry's namespace: `python registry_gate.py UPSTREAM BIND PORT GOOD LOG` (LOG: one line
per GET, `PATH TOKEN|-`).
"""

from __future__ import annotations

import http.client
import http.server
import sys
import threading
from typing import Any


class Gate:
    def __init__(self, upstream: str, good: str, bind: str = "127.0.0.1", port: int = 0,
                 log: str = "") -> None:  # fmt: skip
        self.seen: list[tuple[str, bool]] = []  # (path, whether a token came)
        gate = self
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization", "")
                with lock:
                    gate.seen.append((self.path, bool(auth)))
                    if log:
                        with open(log, "a") as f:
                            f.write(f"{self.path} {'token' if auth else '-'}\n")
                if auth and auth != f"Bearer {good}":
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"invalid token"}]}'
                    self.send_response(401)
                    self.send_header("WWW-Authenticate",
                                     'Bearer realm="feos-test",error="invalid_token"')
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection(upstream, timeout=30)
                conn.request("GET", self.path,
                             headers={"Accept": self.headers.get("Accept", "*/*")})
                resp = conn.getresponse()
                body = resp.read()
                self.send_response(resp.status)
                for key in ("Content-Type", "Docker-Content-Digest", "Location"):
                    if resp.getheader(key):
                        self.send_header(key, resp.getheader(key) or "")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                conn.close()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((bind, port), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blobs(self) -> list[str]:
        return [path for path, _ in self.seen if "/blobs/" in path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    upstream, bind, port, good, log = sys.argv[1:6]
    Gate(upstream, good, bind, int(port), log).thread.join()
