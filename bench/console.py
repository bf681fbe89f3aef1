"""The web console's two figures, with a warm headless Chromium and real pods.

Run as root, under the VM lock: .venv/bin/python bench/console.py [--pods 200] [--changes 50]

feosd runs with --web on a free loopback port in a temporary directory. Every pod is a real pod
made through the console's calls, which are the API's own handlers (feos/web/_api.py): created
with no network and an image no registry holds, and stopped at once, so none boots.

- The pods page at 200 pods: from the navigation's start to the list rendered (the page's
  `podsRenderedAt`, performance.now() when it has drawn the list it read), median of 10 loads
  of a browser already warm (the page loaded once before).
- A change's latency: from feosd's timestamp of a pod's state change (PodEvent.timeUnixNs, taken
  when the pod service publishes it) to the page showing it, by a MutationObserver's clock
  (performance.timeOrigin + performance.now() when the card carrying that event is put in the
  DOM), p95 over at least 50 changes (pods created and stopped: two changes each, plus the steps
  the bring-up publishes before the stop ends it). Both clocks are this machine's wall clock.
Targets: the event p95 under 100 ms; the page under 200 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))

from feosd_proc import Feosd, end_microvms  # noqa: E402
from web_browser import browser, free_port, missing  # noqa: E402

ALPHA = "abcdefghjkmnpqrstvwxyz"
DIGITS = "0123456789" + ALPHA
OBSERVE = """
window.seen = [];
const known = new Set();
new MutationObserver((records) => {
  const t = performance.timeOrigin + performance.now();
  for (const r of records) for (const n of r.addedNodes) {
    const s = n.querySelector ? n.querySelector('[data-state]') : null;
    const ns = s && s.dataset.eventNs;
    if (ns && !known.has(ns)) { known.add(ns); window.seen.push([ns, t]); }
  }
}).observe(document.getElementById('pods'), {childList: true, subtree: true});
"""


def pod_id() -> str:
    return random.choice(ALPHA) + "".join(random.choice(DIGITS) for _ in range(10))


class Console:
    """The console's calls, as its page makes them (origin and CSRF token included)."""

    def __init__(self, url: str) -> None:
        self.url = url
        page = urllib.request.urlopen(url + "/").read().decode()
        self.csrf = page.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]

    def call(self, service: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/api/{service}/{method}", data=json.dumps(params).encode(),
            headers={"origin": self.url, "x-csrf-token": self.csrf,
                     "content-type": "application/json"})
        answer: dict[str, Any] = json.loads(urllib.request.urlopen(request).read())
        if "status" in answer:
            raise RuntimeError(f"{method}: {answer['status']}")
        return answer

    def pod(self, image: str = "127.0.0.1:9/nothing/here:1") -> str:
        spec = {"vcpus": 1, "memoryMib": 128, "network": {"none": None},
                "containers": [{"name": "main", "image": image}]}
        new = pod_id()
        self.call("pods", "createPod", {"id": new, "spec": spec})
        self.call("pods", "stopPod", {"id": new})
        return new


def wait(driver: Any, script: str, timeout: float = 120) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.01).until(
        lambda d: d.execute_script(script))


def page_load(driver: Any, url: str, count: int, runs: int) -> list[float]:
    ready = f"return document.getElementById('pods').dataset.count === '{count}'" \
            " && window.podsRenderedAt"
    driver.get(url + "/")
    wait(driver, ready)  # warm: the page, its assets and the connection
    times = []
    for _ in range(runs):
        driver.get(url + "/?" + str(len(times)))
        times.append(float(wait(driver, ready)))
    return times


def event_latency(driver: Any, console: Console, changes: int) -> list[float]:
    driver.get(console.url + "/")
    wait(driver, "return document.body.dataset.ready === '1'")
    driver.execute_script(OBSERVE)
    while True:
        seen = driver.execute_script("return window.seen.length")
        if seen >= changes:
            break
        console.pod()
    wait(driver, "return document.querySelectorAll('[data-state]').length > 0")
    seen = driver.execute_script("return window.seen")
    return [t - int(ns) / 1e6 for ns, t in seen]


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--loads", type=int, default=10)
    args = parser.parse_args()
    if missing():
        sys.exit(f"bench/console.py: {missing()}")
    root = Path(tempfile.mkdtemp(prefix="feos-bench-console-"))
    port = free_port()
    node = Feosd(root / "node", "--web", f"127.0.0.1:{port}", "--log-level", "WARNING")
    url = f"http://127.0.0.1:{port}"
    node.start()
    driver = browser(root)
    try:
        console = Console(url)
        for _ in range(args.pods):
            console.pod()
        loads = page_load(driver, url, args.pods, args.loads)
        latencies = event_latency(driver, console, args.changes)
    finally:
        driver.quit()
        node.stop(120)
        end_microvms(node.state_dir)
        shutil.rmtree(root, ignore_errors=True)
    page = statistics.median(loads)
    event = p95(latencies)
    print(f"pods page at {args.pods} pods: median {page:.1f} ms, least {min(loads):.1f} ms, "
          f"most {max(loads):.1f} ms over {len(loads)} loads")
    print(f"console event latency over {len(latencies)} changes: median "
          f"{statistics.median(latencies):.1f} ms, p95 {event:.1f} ms, most {max(latencies):.1f} ms")
    print(f"ratio console event p95 / 100 ms: {event / 100:.2f} (target < 1)")
    print(f"ratio pods page at {args.pods} pods / 200 ms: {page / 200:.2f} (target < 1)")


if __name__ == "__main__":
    main()
