"""The mesh, measured: (1) TCP throughput over feosd's feos-mesh against the same wireguard-go
set up by hand with wg(8), (2) an UpdateMeshPeers of one peer with 1,000 present against a
PutMeshPeers of 1,000.

(1) Two pairs of throwaway namespaces (feosbench-*), each pair joined by a veth underlay. In
one, feos.net's Mesh makes and configures feos-mesh on each side as feosd does (JoinMesh's
answer, then the other side as the one peer); in the other, wireguard-go is started and set up
by hand (`wg set`, `ip link`, `ip route`) with the same kind of keys, MTU and prefixes. iperf3
runs between an address of each side's /96 for 3 s, the two setups back to back (a pair, each
first every other pair), ROUNDS_T pairs in each of two sessions: one with feosd's setup made
first, one with the hand-made one first. The ratio is the median of the pairs' ratios: the load
of the rest of the machine drifts over a run, and falls on both streams of a pair alike.

(2) One Mesh in a namespace with 1,000 peers: a PutMeshPeers of 1,000 new peers (from none)
beside an UpdateMeshPeers that changes one peer's endpoint a second later (not in the write-back
of the put's own write), each timed whole as a call takes it (the checks, the change kept and
synced: mesh.pb whole for the put, one entry of its journal for the update; the device told),
median of ROUNDS.

Run as root: .venv/bin/python bench/mesh.py. The last lines are the `ratio ...` lines.
"""

from __future__ import annotations

import ipaddress as ip
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feos.net import Mesh, UapiDevice

ROUNDS = 5
ROUNDS_T = 12  # pairs of streams per session
SECONDS = 3
PEERS = 1000
ULA = ip.IPv6Network("fd12:3456:789a:1::/64")
PREFIX = {"a": ip.IPv6Network("fd12:3456:789a:1:0:1::/96"),
          "b": ip.IPv6Network("fd12:3456:789a:1:0:2::/96")}
UNDER = {"a": "10.99.0.1", "b": "10.99.0.2"}


def sh(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def pair(tag: str) -> dict[str, str]:
    names = {n: f"feosbench-{tag}{n}-{secrets.token_hex(2)}" for n in ("a", "b")}
    for ns in names.values():
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", names["a"], "link", "add", "under", "type", "veth", "peer", "name", "under",
       "netns", names["b"])
    for n, ns in names.items():
        sh("ip", "-n", ns, "addr", "add", f"{UNDER[n]}/24", "dev", "under")
        sh("ip", "-n", ns, "link", "set", "under", "up")
        sh("ip", "-n", ns, "addr", "add", f"{PREFIX[n][5]}/128", "dev", "lo")
    return names


async def feosd_mesh(names: dict[str, str], root: Path) -> list[Mesh]:
    meshes = {n: Mesh(root / n / "mesh", root / n / "run", 51820, netns=ns)
              for n, ns in names.items()}
    for n, m in meshes.items():
        await m.start()
        await m.take_join({"meshed": True, "ula": str(ULA), "prefix": str(PREFIX[n])})
    for n, m in meshes.items():
        other = "b" if n == "a" else "a"
        await m.put_mesh_peers({"version": 1, "peers": [{
            "publicKey": meshes[other].state.public_key, "endpoint": f"{UNDER[other]}:51820",
            "prefix": str(PREFIX[other])}]})
    return list(meshes.values())


def hand_made(names: dict[str, str], root: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """wireguard-go and wg(8), as an operator would set them up (a device name each: their
    UAPI sockets share /run/wireguard); its processes in `procs`, ended by the caller. Each in
    a session of its own, as feosd's is: the scheduler's autogroups (one per session) then
    weigh both setups' processes alike."""
    tag = secrets.token_hex(3)
    devs = {n: f"wg{n}{tag}" for n in names}
    root.mkdir(parents=True, exist_ok=True)
    keys = {}
    for n in names:
        private = sh("wg", "genkey").strip()
        keys[n] = (private, subprocess.run(["wg", "pubkey"], input=private, capture_output=True,
                                           text=True, check=True).stdout.strip())
        (root / f"{n}.key").write_text(private + "\n")
    env = dict(os.environ, WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD="1", LOG_LEVEL="error")
    for n, ns in names.items():
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "wireguard-go", "-f", devs[n]],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
            Path(f"/run/wireguard/{d}.sock").exists() for d in devs.values()):
        time.sleep(0.05)
    for n, ns in names.items():
        dev = devs[n]
        other = "b" if n == "a" else "a"
        sh("ip", "netns", "exec", ns, "wg", "set", dev, "private-key", str(root / f"{n}.key"),
           "listen-port", "51821", "peer", keys[other][1], "endpoint", f"{UNDER[other]}:51821",
           "allowed-ips", str(PREFIX[other]))
        sh("ip", "-n", ns, "link", "set", dev, "mtu", "1420", "up")
        sh("ip", "-n", ns, "-6", "route", "add", str(ULA), "dev", dev)


def iperf(names: dict[str, str], seconds: int = SECONDS) -> float:
    """Bits per second received, a TCP stream from a's /96 to b's for `seconds`."""
    server = subprocess.Popen(["ip", "netns", "exec", names["b"], "iperf3", "-s", "-1", "-B",
                               str(PREFIX["b"][5])], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = sh("ip", "netns", "exec", names["a"], "iperf3", "-J", "-c", str(PREFIX["b"][5]),
                 "-B", str(PREFIX["a"][5]), "-t", str(seconds))
        return float(json.loads(out)["end"]["sum_received"]["bits_per_second"])
    finally:
        server.wait(10)


def session(root: Path, *, feos_first: bool, rounds: int) -> list[tuple[float, float]]:
    """Both setups made (in the order asked), then measured in pairs, one right after the other,
    each first every other pair (ABBA); (mesh, hand-made) per pair. The setup made first measured
    slower here whichever it was (two feosd setups side by side differed as much): the caller
    runs a session of each order."""
    made: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    meshes: list[Mesh] = []
    names: dict[str, dict[str, str]] = {}
    try:
        for which in (("mesh", "hand") if feos_first else ("hand", "mesh")):
            names[which] = pair(which[0])
            made += names[which].values()
            if which == "mesh":
                meshes = trio.run(feosd_mesh, names[which], root / "feos")
            else:
                hand_made(names[which], root, procs)
        for which in names:
            iperf(names[which], seconds=1)  # a first stream each: its handshake, its caches
        got: list[tuple[float, float]] = []
        for r in range(rounds):
            pair_bps: dict[str, float] = {}
            for which in (("mesh", "hand") if r % 2 == 0 else ("hand", "mesh")):
                pair_bps[which] = iperf(names[which])
            got.append((pair_bps["mesh"], pair_bps["hand"]))
        return got
    finally:
        for m in meshes:
            assert isinstance(m.device, UapiDevice)
            m.device.stop()
            m.close()
        for p in procs:
            p.terminate()
            p.wait(10)
        for ns in made:
            sh("ip", "netns", "delete", ns, check=False)


def throughput_part(root: Path) -> tuple[list[str], list[str]]:
    """The ratio is the median of the pairs' ratios: each pair measured within seconds of
    itself, so that the load of the rest of the machine, which changes over a run, falls on
    both of a pair alike."""
    pairs: list[tuple[float, float]] = []
    lines = []
    for n, feos_first in enumerate((True, False)):
        part = session(root / str(n), feos_first=feos_first, rounds=ROUNDS_T)
        pairs += part
        lines.append(f"session {n + 1} ({'feosd' if feos_first else 'the hand-made'} setup "
                     f"made first): mesh {statistics.median(a for a, _ in part) / 1e6:.0f}, "
                     f"hand-made {statistics.median(b for _, b in part) / 1e6:.0f} Mbit/s")
    mesh = statistics.median(a for a, _ in pairs)
    hand_bps = statistics.median(b for _, b in pairs)
    ratios = sorted(a / b for a, b in pairs)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    lines += [f"TCP over feos-mesh (feosd's setup): {mesh / 1e6:.0f} Mbit/s (median of "
              f"{len(pairs)})",
              f"TCP over wireguard-go set up with wg(8): {hand_bps / 1e6:.0f} Mbit/s",
              f"the pairs' ratios: {ratios[0]:.3f} to {ratios[-1]:.3f}, quartiles {q1:.3f} "
              f"and {q3:.3f}"]
    return lines, [f"ratio mesh / hand-made wireguard-go: {statistics.median(ratios):.3f} "
                   "(target >= 0.9)"]


def peer(n: int, port: int = 51820) -> dict[str, object]:
    return {"publicKey": n.to_bytes(4, "big") + b"\x01" * 28,
            "endpoint": f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}:{port}",
            "prefix": str(ip.IPv6Network((int(ULA.network_address) + ((n + 16) << 32), 96)))}


async def peers_part_async(root: Path, ns: str) -> tuple[list[str], list[str]]:
    mesh = Mesh(root / "mesh", root / "run", 51820, netns=ns)
    try:
        await mesh.start()
        await mesh.take_join({"meshed": True, "ula": str(ULA), "prefix": str(PREFIX["a"])})
        puts, updates = [], []
        version = 0
        for r in range(ROUNDS):
            version += 1
            await mesh.put_mesh_peers({"version": version, "peers": []})  # from none
            version += 1
            began = time.perf_counter()
            await mesh.put_mesh_peers({"version": version, "peers": [peer(n) for n in
                                                                      range(PEERS)]})
            puts.append(time.perf_counter() - began)
            await trio.sleep(1)  # the put's writes written back: an update with 1,000 present
            began = time.perf_counter()
            await mesh.update_mesh_peers({"fromVersion": version, "toVersion": version + 1,
                                          "put": [peer(r * 7, 51900 + r)]})
            updates.append(time.perf_counter() - began)
            version += 1
        assert len(mesh.device.read().peers) == PEERS
    finally:
        assert isinstance(mesh.device, UapiDevice)
        mesh.device.stop()
        mesh.close()
    put, update = statistics.median(puts), statistics.median(updates)
    lines = [f"PutMeshPeers of {PEERS} peers: {put * 1e3:.1f} ms (median of {ROUNDS})",
             f"UpdateMeshPeers of one peer, {PEERS} present: {update * 1e3:.2f} ms"]
    return lines, [f"ratio one peer updated / {PEERS} peers put: {update / put:.4f} "
                   "(target < 0.05)"]


def peers_part(root: Path) -> tuple[list[str], list[str]]:
    ns = f"feosbench-p-{secrets.token_hex(2)}"
    sh("ip", "netns", "add", ns)
    try:
        return trio.run(peers_part_async, root, ns)
    finally:
        sh("ip", "netns", "delete", ns, check=False)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="feosbench-mesh-", dir="/var/tmp") as tmp:
        t_lines, t_ratios = throughput_part(Path(tmp) / "t")
        p_lines, p_ratios = peers_part(Path(tmp) / "p")
    for line in [*t_lines, *p_lines, *t_ratios, *p_ratios]:
        print(line)


if __name__ == "__main__":
    main()
