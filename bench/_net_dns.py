"""The pods' resolver against dnsmasq as a forwarder: queries per second with dnsperf.

Three namespaces made for the run and removed after it: a pod (dnsperf, from the pod's IPv4
address), the node (the resolver at 169.254.0.53, or dnsmasq forwarding in its place) and an
upstream (dnsmasq answering example.test from its own configuration: a "cached-upstream"
workload, no upstream of its own). Each run lasts RUN_SECONDS; ROUNDS rounds, each side once per
round in turn (so that the load of others on this shared machine falls on both alike), and the
median of each side's runs is its figure. dnsperf's settings are the same for every side. Needs
root, dnsmasq and dnsperf.

    .venv/bin/python bench/_net_dns.py          # prints the lines run() returns
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN_SECONDS = 4
ROUNDS = 5  # the median of 5 a side: the machine is shared, single runs move by 15 %
RESOLVER, POD_IP, UP4 = "169.254.0.53", "169.254.16.5", "10.53.0.2"
NAMES = 200


def _ip(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=check
    )


def _topology(tag: str) -> tuple[str, str, str]:
    node, pod, up = (f"feosbench-{k}-{tag}" for k in ("node", "pod", "up"))
    for ns in (node, pod, up):
        subprocess.run(["ip", "netns", "add", ns], check=True)
        _ip(ns, "ip", "link", "set", "lo", "up")
    subprocess.run(
        ["ip", "link", "add", "vp", "netns", node, "type", "veth", "peer", "vpp", "netns", pod],
        check=True,
    )
    subprocess.run(
        ["ip", "link", "add", "vu", "netns", node, "type", "veth", "peer", "vuu", "netns", up],
        check=True,
    )
    for ns, cmds in (
        (
            node,
            [
                f"addr add {RESOLVER}/32 dev vp",
                "link set vp up",
                "route add 169.254.16.0/24 dev vp",
                "addr add 10.53.0.1/24 dev vu",
                "link set vu up",
            ],
        ),
        (
            pod,
            [
                f"addr add {POD_IP}/32 dev vpp",
                "link set vpp up",
                f"route add {RESOLVER}/32 dev vpp",
            ],
        ),
        (up, [f"addr add {UP4}/24 dev vuu", "link set vuu up"]),
    ):
        for cmd in cmds:
            _ip(ns, "ip", *cmd.split())
    return node, pod, up


def _wait_answer(pod: str) -> None:
    for _ in range(100):
        out = _ip(
            pod,
            "dig",
            f"@{RESOLVER}",
            "-b",
            POD_IP,
            "h0.example.test",
            "+short",
            "+time=1",
            "+tries=1",
            check=False,
        ).stdout
        if out.strip() == "192.0.2.7":
            return
        time.sleep(0.1)
    raise RuntimeError("the forwarder under test does not answer")


def _dnsperf(pod: str, queries: Path) -> tuple[float, int]:
    """Queries per second and queries answered: the same client settings for every side."""
    out = _ip(
        pod,
        "dnsperf",
        "-s",
        RESOLVER,
        "-a",
        POD_IP,
        "-d",
        str(queries),
        "-l",
        str(RUN_SECONDS),
        "-c",
        "8",
        "-q",
        "200",
        "-t",
        "2",
    ).stdout
    rate = re.search(r"Queries per second:\s+([\d.]+)", out)
    done = re.search(r"Queries completed:\s+(\d+)", out)
    if rate is None or done is None:
        raise RuntimeError(f"dnsperf said: {out}")
    # Lost queries (past dnsperf's 2 s timeout) are not in the rate: it counts answers.
    return float(rate.group(1)), int(done.group(1))


def _cpu_seconds(pid: int) -> float:
    """user + system time of a process (ip netns exec execs the command in place: its pid)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(node: str, pod: str, queries: Path, argv: list[str]) -> tuple[float, float]:
    """Queries per second, and the server's CPU microseconds per query answered: the figure
    that other work on this shared machine moves least (it takes CPU, not cycles per query)."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_answer(pod)
        before = _cpu_seconds(proc.pid)
        rate, done = _dnsperf(pod, queries)
        return rate, (_cpu_seconds(proc.pid) - before) / max(done, 1) * 1e6
    finally:
        proc.terminate()
        proc.wait(10)


def run() -> list[str]:
    tag = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix="feosbench-dns-"))
    queries = tmp / "queries"
    queries.write_text("".join(f"h{i}.example.test {('A', 'AAAA')[i % 2]}\n" for i in range(NAMES)))
    made: list[str] = []
    upstream = None
    try:
        node, pod, up = _topology(tag)
        made = [node, pod, up]
        upstream = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                up,
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                f"--listen-address={UP4}",
                "--user=root",
                f"--pid-file={tmp}/up.pid",
                "--address=/example.test/192.0.2.7",
                "--address=/example.test/2001:db8::7",
                "--local-ttl=300",
                "--cache-size=10000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        me = [sys.executable, os.path.abspath(__file__), "--serve"]
        dnsmasq = [
            "dnsmasq",
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            f"--listen-address={RESOLVER}",
            "--user=root",
            f"--pid-file={tmp}/fwd.pid",
            f"--server={UP4}",
            "--cache-size=10000",
        ]
        sides = {"cached": [*me, "cache"], "plain": [*me, "nocache"], "dnsmasq": dnsmasq}
        rates: dict[str, list[float]] = {side: [] for side in sides}
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(ROUNDS):
            for side, argv in sides.items():
                rate, per_query = _measure(node, pod, queries, argv)
                rates[side].append(rate)
                cpu[side].append(per_query)
    finally:
        if upstream is not None:
            upstream.terminate()
            upstream.wait(10)
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], check=False)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    ours, plain, theirs = (statistics.median(rates[k]) for k in ("cached", "plain", "dnsmasq"))
    cpu_ours, cpu_plain, cpu_theirs = (
        statistics.median(cpu[k]) for k in ("cached", "plain", "dnsmasq")
    )

    def runs(side: str) -> str:
        return (
            f"(median of {ROUNDS} runs of {RUN_SECONDS} s: "
            + ", ".join(f"{q / 1000:.1f}k" for q in rates[side])
            + "; CPU per query "
            + ", ".join(f"{c:.1f}" for c in cpu[side])
            + " us)"
        )

    return [
        f"dnsmasq forwarding (cache 10000): {theirs:.0f} qps {runs('dnsmasq')}",
        f"resolver with its answer cache: {ours:.0f} qps {runs('cached')}",
        f"resolver without a cache (every query upstream): {plain:.0f} qps {runs('plain')}",
        f"ratio resolver qps / dnsmasq qps: {ours / theirs:.3f} (target >= 1)",
        f"ratio resolver without cache qps / dnsmasq qps: {plain / theirs:.3f} (target >= 1)",
        f"CPU per query (us, median): dnsmasq {cpu_theirs:.1f}, resolver with its cache "
        f"{cpu_ours:.1f}, without {cpu_plain:.1f} (the machine's load moves it least)",
    ]


def _serve(mode: str) -> None:
    """The resolver in the node's namespace: one pod, no name tables, the upstream dnsmasq."""
    import trio

    from feos.net._dnscache import AnswerCache
    from feos.net._dnsresolver import PodDns
    from feos.net._dnsserver import DnsServer
    from feos.net._listenfds import bind_dns_sockets

    pod = PodDns("benchpod000")
    sockets = bind_dns_sockets(ipaddress.IPv4Address(RESOLVER))

    async def main() -> None:
        server = DnsServer(
            sockets,
            pod_for=lambda a: pod if str(a) == POD_IP else None,
            name_tables=dict,
            on_record=lambda record: None,
            default_upstreams=(ipaddress.ip_address(UP4),),
            cache=AnswerCache() if mode == "cache" else None,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            server.pods_loaded()

    trio.run(main)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2])
    else:
        print("\n".join(run()))
