"""The API's unavailable time across `systemctl restart feosd`, with ten running pods beside none,
and the DNS queries sent throughout (each must be answered).

Where: feosd installed from its Debian package (a build of the work tree, published into a
signed local repository) in a Debian 12 root booted by systemd-nspawn, systemd its PID 1 (this
machine's own PID 1 is not systemd, so there is no host unit to restart): the same root and
harness as integration/test_deb_packages.py. The pods are QEMU microVMs under TCG without
containers or a network: a container's image comes from a registry, which the root (a private
network) cannot reach. So the DNS queries come from the node itself, not from inside a pod: they
go to the resolver's address, 169.254.0.53:53, held by feosd.socket, and a query that arrives
while feosd restarts waits in the socket; feosd answers it (REFUSED: the node is no pod) once it
is back. A query counts as lost when no answer comes within 30 s.

The unavailable time is from the first failed API call (GetHostInfo on a new connection, polled
every 10 ms) to the first answered one after it. Three restarts each way; the medians compared.
Run under the VM lock: `flock /tmp/feos-vm.lock .venv/bin/python bench/restart.py`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "integration"))

from debroot import Container, booted  # noqa: E402

PODS = 10
ROUNDS = 3
VERSION = "0.1.0~dev.0"
PY = "python3 -I -c 'import sys; sys.path.insert(0, \"/usr/lib/feos/python\"); exec(sys.stdin.read())'"
NO_CONTAINERS = '{"containers": [], "network": {"none": null}}'

# Inside the root: the API polled every 10 ms and a DNS query every 20 ms on a thread, from one
# second before `systemctl restart feosd` until two seconds after the API answers again.
PROBE = r'''
import asyncio, json, socket, struct, subprocess, threading, time
import capnp
from feos.rpc import Client

stop = threading.Event()
dns = {"sent": 0, "answered": 0}

def dns_sender():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(30)
    n = 0
    while not stop.is_set():
        n += 1
        qid = n & 0xFFFF
        q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + b"\x05probe\x04feos\x00"
        s.sendto(q + struct.pack(">HH", 1, 1), ("169.254.0.53", 53))
        dns["sent"] += 1
        try:
            while True:
                data, _ = s.recvfrom(4096)
                if data[:2] == struct.pack(">H", qid):
                    dns["answered"] += 1
                    break
        except socket.timeout:
            pass
        time.sleep(0.02)

async def answers():
    try:
        c = await asyncio.wait_for(Client.connect_unix("/run/feos/api.sock"), 2)
    except Exception:
        return False
    try:
        await asyncio.wait_for(c.call("host", "getHostInfo"), 2)
        return True
    except Exception:
        return False
    finally:
        c.close()

async def main():
    t = threading.Thread(target=dns_sender)
    t.start()
    start = time.monotonic()
    restart = None
    first_fail = back = None
    while True:
        now = time.monotonic()
        if restart is None and now - start > 1:
            restart = subprocess.Popen(["systemctl", "restart", "feosd.service"])
        ok = await answers()
        now = time.monotonic()
        if not ok and first_fail is None and restart is not None:
            first_fail = now
        if ok and first_fail is not None and back is None:
            back = now
        if back is not None and now - back > 2 and restart.poll() is not None:
            break
        if now - start > 300:
            break
        await asyncio.sleep(0.01)
    stop.set()
    t.join()
    gap = (back - first_fail) if first_fail is not None and back is not None else None
    print(json.dumps({"unavailable_s": gap, **dns}))

asyncio.run(capnp.run(main()))
'''


def build_repo(work: Path) -> Path:
    out, repo = work / "debs", work / "apt"
    subprocess.run([sys.executable, str(ROOT / "packaging/deb/build.py"), "--dist", "bookworm",
                    "--out", str(out), "--version", VERSION], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, str(ROOT / "packaging/deb/repo.py"), "--repo", str(repo),
                    "--gnupg-home", str(work / "apt.key"), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return repo


def measure(c: Container) -> tuple[float, int, int]:
    gaps, sent, answered = [], 0, 0
    for _ in range(ROUNDS):
        result = json.loads(c.sh(PY, input=PROBE, timeout=400).stdout.strip().splitlines()[-1])
        if result["unavailable_s"] is None:
            raise SystemExit(f"restart: no unavailable window was seen: {result}")
        gaps.append(result["unavailable_s"])
        sent += result["sent"]
        answered += result["answered"]
    return statistics.median(gaps), sent, answered


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="feos-bench-restart-") as tmp:
        work = Path(tmp)
        print("building and publishing the packages (Debian 12) ...", flush=True)
        repo = build_repo(work)
        with booted("bookworm", work / "root", binds={"/srv/feos-apt": repo}) as c:
            c.sh("echo 'deb [signed-by=/srv/feos-apt/feos.gpg] file:/srv/feos-apt oldstable "
                 "main' > /etc/apt/sources.list.d/feos.list && apt-get update -q && "
                 "apt-get install -y -q feosd feosctl")
            c.sh("sed -i 's|^FEOSD_ARGS=.*|FEOSD_ARGS=\"--pod-prefix fd12:3456:789a:1::/64\"|' "
                 "/etc/default/feosd && systemctl restart feosd.service")
            none, sent0, answered0 = measure(c)
            print(f"restart with no pods: API unavailable {none * 1000:.0f} ms (median of "
                  f"{ROUNDS})", flush=True)
            for i in range(PODS):
                c.sh(f"feosctl pod create rstbench{i:03d} -f - --wait", input=NO_CONTAINERS,
                     timeout=600)
            running = c.sh("feosctl pod list").stdout.count(" running ")
            print(f"{running} pods running (QEMU under TCG)", flush=True)
            with_pods, sent1, answered1 = measure(c)
            print(f"restart with {PODS} pods: API unavailable {with_pods * 1000:.0f} ms "
                  f"(median of {ROUNDS})")
            sent, answered = sent0 + sent1, answered0 + answered1
            print(f"DNS queries sent throughout: {sent}, answered: {answered}")
            print(f"DNS queries lost: {sent - answered} (must be 0)")
            print(f"ratio restart with {PODS} pods / with none: {with_pods / none:.2f} "
                  f"(target < 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
