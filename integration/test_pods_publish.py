"""A published port of a real pod, as a user runs it: `feosctl pod create --publish 8080:8080`.

One node (podnet.PodNet: feosd in a namespace of its own, the internet in another) and one
microVM serving HTTP (busybox httpd). The pod is reached through the node's port from the
internet namespace over IPv4 and IPv6 and from the node itself (its addresses, 127.0.0.1 and
::1); ports already held are refused at create without a boot; after feosd is killed and the
table taken away, the new feosd puts the publish back from the kept pod; the delete takes it back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from _netpods import POD_PORT, server_command
from podnet import IMAGE, NODE_V4, NODE_V6, PodNet

POD, OTHER = "pp0000000aa", "pp0000000bb"
HOST_PORT = 8080
PAGE = "hello-through-the-node"
# GET http://host:port/ from wherever it runs; prints the body, or what failed
GET = ("import http.client,sys\n"
       "c=http.client.HTTPConnection(sys.argv[1],int(sys.argv[2]),timeout=5)\n"
       "try:\n c.request('GET','/'); print(c.getresponse().read().decode().strip())\n"
       "except OSError as e: print('error:', e)\n")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodNet]:
    with PodNet(tmp_path_factory.mktemp("podpublish")) as node:
        yield node


def get_in(net: PodNet, where: str, host: str, port: int = HOST_PORT) -> str:
    """The page fetched from the internet namespace ("inet") or the node's ("node")."""
    wrap = net.in_inet if where == "inet" else net.in_node
    done = subprocess.run(wrap(sys.executable, "-c", GET, host, str(port)), capture_output=True,
                          text=True, timeout=60)
    return done.stdout.strip()


def reached_everywhere(net: PodNet) -> dict[str, str]:
    return {f"{where} {host}": get_in(net, where, host)
            for where, host in (("inet", NODE_V4), ("inet", NODE_V6), ("node", NODE_V4),
                                ("node", NODE_V6), ("node", "127.0.0.1"), ("node", "::1"))}


def test_a_published_pod_is_reached_over_both_families(net: PodNet) -> None:
    pod = net.ctl_json("pod", "create", POD, "--wait", "--memory", "256MiB",
                       "--publish", f"{HOST_PORT}:{POD_PORT}", "--image", IMAGE,
                       "--cmd", *server_command(PAGE))
    assert pod["state"] == "running", pod
    assert pod["spec"]["network"]["pod"]["publish"] == [
        {"protocol": "tcp", "hostAddress": "", "hostPort": HOST_PORT, "podPort": POD_PORT}]
    shown = [line.split() for line in net.ctl("pod", "get", POD).stdout.splitlines()]
    assert ["publish", f"{HOST_PORT}:{POD_PORT}/tcp"] in shown, shown
    serving(net)
    got = reached_everywhere(net)
    assert got == dict.fromkeys(got, PAGE), (got, table(net))


def serving(net: PodNet, timeout: float = 60) -> None:
    """Until httpd answers inside the pod (its container runs before httpd listens)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = net.exec(POD, "busybox", "wget", "-q", "-O-", f"http://127.0.0.1:{POD_PORT}/",
                        check=False)
        if done.returncode == 0 and done.stdout.strip() == PAGE:
            return
        time.sleep(0.2)
    raise AssertionError("the pod's httpd does not answer inside the pod")


def table(net: PodNet) -> str:
    return subprocess.run(net.in_node("nft", "list", "table", "inet", "feos"),
                          capture_output=True, text=True).stdout


def test_held_ports_and_feosd_s_addresses_are_refused_at_create(net: PodNet) -> None:
    def create(*publish: str) -> subprocess.CompletedProcess[str]:
        argv = [a for p in publish for a in ("--publish", p)]
        return net.ctl("pod", "create", OTHER, *argv, "--image", IMAGE, check=False)

    taken = create(f"127.0.0.1:{HOST_PORT}:80")
    assert taken.returncode == 16, taken.stderr  # ALREADY_EXISTS
    assert f"pod {POD} publishes {HOST_PORT}:{POD_PORT}/tcp" in taken.stderr
    listener = subprocess.Popen(
        net.in_node(sys.executable, "-c", "import socket,sys; s=socket.socket(); "
                    "s.bind(('0.0.0.0', 7070)); s.listen(); print('up', flush=True); "
                    "sys.stdin.read()"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline() == "up\n"
        held = create("7070:80")
        assert held.returncode == 16 and "the node listens on 0.0.0.0:7070/tcp" in held.stderr
    finally:
        listener.kill()
        listener.communicate()
    metadata = create("169.254.169.254:80:80")
    assert metadata.returncode == 13 and "link-local" in metadata.stderr  # INVALID_ARGUMENT
    assert create("70000:80").returncode == 13
    assert net.ctl("pod", "get", OTHER, check=False).returncode == 15  # NOT_FOUND: never made


def test_the_publish_is_put_back_after_a_restart_of_feosd(net: PodNet) -> None:
    net.kill_feosd()  # the microVM goes on
    subprocess.run(net.in_node("nft", "delete", "table", "inet", "feos"), check=True)
    assert get_in(net, "inet", NODE_V4).startswith("error")
    net.start_feosd()
    net.wait_state(POD, "running")
    got = reached_everywhere(net)
    assert got == dict.fromkeys(got, PAGE), (got, table(net))


def test_the_delete_takes_the_publish_back(net: PodNet) -> None:
    net.ctl("pod", "delete", POD)
    for where, host in (("inet", NODE_V4), ("inet", NODE_V6), ("node", "127.0.0.1"),
                        ("node", "::1")):
        assert get_in(net, where, host).startswith("error"), (where, host)
