"""A real S3 endpoint on loopback for tests and benchmarks: moto's server mode.

    with moto_s3() as s3:          # moto_server on a free port of 127.0.0.1, one bucket made
        env = s3.env()             # S3_BUCKET, AWS_ENDPOINT_URL, AWS_* as /etc/default/diskd has
        s3.client().list_objects_v2(Bucket=s3.bucket)

The server runs in a session of its own under integration/_owner.py's OWNER: it ends when the
context ends, also when the body fails, and at the latest when the run ends (SIGTERM too).
`auth=True` starts one that checks credentials (moto's INITIAL_NO_AUTH_ACTION_COUNT=0): every
key it is given is unknown to it, so it refuses everything, as a bucket with bad keys does.
Import it with integration/ on sys.path (pytest puts it there for the tests in integration/;
kernel tests and benchmarks insert it themselves).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import boto3
import botocore.config
from _owner import OWNER, end_group

MOTO_SERVER = Path(sys.executable).parent / "moto_server"
KEY_ID, SECRET = "testing", "testing"  # moto takes any keys unless auth is on


@attrs.frozen
class MotoS3:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    log: Path
    pid: int = 0  # moto_server's (a test may stop it for a while: SIGSTOP, SIGCONT)

    def env(self, **extra: str) -> dict[str, str]:
        """The object store's environment as /etc/default/diskd would hold it."""
        return {"S3_BUCKET": self.bucket, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": KEY_ID,
                "AWS_SECRET_ACCESS_KEY": SECRET, **extra}  # fmt: skip

    def client(self) -> Any:
        """A boto3 client of the endpoint, for a test's own looks and damage."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
            config=botocore.config.Config(s3={"addressing_style": "path"},
                                          retries={"total_max_attempts": 1}),
        )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_s3(
    log_dir: Path, bucket: str = "feos-test", *, auth: bool = False, timeout: float = 30.0
) -> Iterator[MotoS3]:
    """moto_server on a free loopback port with `bucket` made (none with auth), ended after."""
    if not MOTO_SERVER.exists():
        raise RuntimeError(f"{MOTO_SERVER} is missing: hack/install installs moto[server]")
    port = free_port()
    log = log_dir / f"moto-{port}.log"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0" if auth else "inf")
    with open(log, "ab") as out:
        proc = OWNER.popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
                           stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        s3 = MotoS3(f"http://127.0.0.1:{port}", bucket, log, proc.pid)
        _wait_answering(proc, port, log, timeout)
        if not auth:
            s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        end_group(proc)
        OWNER.forget(proc)


def _wait_answering(proc: subprocess.Popen[Any], port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server ended ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"GET /moto-api/ HTTP/1.0\r\n\r\n")
                if conn.recv(12).startswith(b"HTTP/1."):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer on port {port} within {timeout:g}s")
