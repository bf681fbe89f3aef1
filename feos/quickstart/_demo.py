"""The demo pod: found, started or made, then waited for until its page answers.

What a run does with the pod POD_ID, by the state it finds (the pod is the one source of truth:
nothing about it is kept beside feosd's record):

| found | done |
| --- | --- |
| none | `pod create POD_ID --publish PORT:8080 --env POD=POD_ID --image IMAGE --wait` |
| running | adopted as it is |
| pending | followed until running (`pod get` every half second) |
| stopped, failed | `pod start --wait` |
| suspended | `pod resume`, then followed |

`--wait` prints the bring-up's steps to the terminal (feosctl's stderr, passed through). Then the
page is fetched through the node's published port on 127.0.0.1 until httpd answers (the container
runs a moment before httpd listens).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from typing import Any

from feos.errors import Code, FeosError

from . import _feosd
from ._feosd import Node, ctl, ctl_json
from ._image import DEMO_PORT

POD_ID = "webdem00001"
_PAGE_WAIT = 60.0


def _ctl_shown(node: Node, *argv: str) -> None:
    """feosctl with its stderr (the steps) shown; its stdout is not needed."""
    done = subprocess.run([str(_feosd.BIN / "feosctl"), "--socket", str(node.socket), *argv],
                          stdout=subprocess.DEVNULL, text=True, timeout=600)
    if done.returncode:
        raise FeosError(Code.UNKNOWN, f"feosctl {' '.join(argv)} failed ({done.returncode})")


def find(node: Node) -> dict[str, Any] | None:
    done = ctl(node, "--json", "pod", "get", POD_ID, check=False)
    if done.returncode == _feosd.NOT_FOUND_EXIT:
        return None
    if done.returncode:
        raise FeosError(Code.UNKNOWN, f"feosctl pod get {POD_ID}: {done.stderr.strip()}")
    pod: dict[str, Any] = json.loads(done.stdout)
    return pod


def bring_up(node: Node, image: str, port: int) -> tuple[dict[str, Any], str]:
    """The demo pod running; with what was done ("created", "adopted", "started", ...)."""
    pod = find(node)
    state = None if pod is None else pod["state"]
    if state is None:
        _ctl_shown(node, "pod", "create", POD_ID, "--wait", "--memory", "256MiB",
                   "--publish", f"{port}:{DEMO_PORT}", "--env", f"POD={POD_ID}",
                   "--image", image)
        done = "created"
    elif state == "running":
        done = "adopted (it was running)"
    elif state in ("stopped", "failed"):
        _ctl_shown(node, "pod", "start", POD_ID, "--wait")
        done = f"started again (it was {state})"
    elif state == "suspended":
        ctl(node, "pod", "resume", POD_ID)
        done = "resumed (it was suspended)"
    else:
        done = f"followed (it was {state})"
    return _running(node), done


def _running(node: Node, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        pod: dict[str, Any] = ctl_json(node, "pod", "get", POD_ID)
        if pod["state"] == "running":
            return pod
        if pod["state"] == "failed" or time.monotonic() > deadline:
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"the demo pod is {pod['state']}: {pod.get('reason') or '?'}")
        time.sleep(0.5)


def published_port(pod: dict[str, Any]) -> int:
    for p in pod["spec"]["network"]["pod"].get("publish", []):
        if p["podPort"] == DEMO_PORT:
            return int(p["hostPort"])
    raise FeosError(Code.FAILED_PRECONDITION, f"pod {POD_ID} publishes no port to {DEMO_PORT}")


def get(host: str, port: int, timeout: float = 5) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/")
        return conn.getresponse().read().decode(errors="replace").strip()
    finally:
        conn.close()


def wait_page(port: int) -> str:
    deadline = time.monotonic() + _PAGE_WAIT
    while True:
        try:
            return get("127.0.0.1", port)
        except OSError as e:
            if time.monotonic() > deadline:
                raise FeosError(Code.UNAVAILABLE, f"the demo's page does not answer: {e}") from e
            time.sleep(0.3)
