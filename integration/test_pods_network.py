"""Pods with a network and containers, as a user runs them: feosctl against feosd, real guests.

One node for the module (podnet.PodNet: feosd in a network namespace of its own, a registry and
a resolver in another). In order, the tests are one user's session on pod A: create with a
container from the registry, exec, logs, the network, suspend and resume, stop and start, delete;
then pod B on A's volume, and three pods that fail, booted side by side (the fixture `failing`
starts their creates at once): a container that cannot be made, an image that does not exist, and
a command that is not in its image. Six boots. Each test also passes alone: the fixture pod_a
makes A (or brings it back to running) for those that need it.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from collections.abc import Iterator

import pytest
from feosd_proc import records_gone, running_pod
from podnet import BAD_USER_IMAGE, IMAGE, IPV4_RANGE, PREFIX, REGISTRY_NAME, REGISTRY_V4, PodNet

VOLUME = "6a1f0c3e-2b4d-4e8f-9a7c-5d3e2f1a0b9c"
A, B, BAD_USER, BAD_IMAGE, BAD_CMD = ("na0000000aa", "nb0000000bb", "nc0000000cc",
                                      "nd0000000dd", "ne0000000ee")
# A counter and a token that only the running shell holds (in its memory), written out as it
# goes: a resumed process goes on with both; a restarted one has a new token and counts anew.
LOOP = ("echo started; t=$(cat /proc/sys/kernel/random/uuid); n=0; "
        "while :; do n=$((n+1)); echo \"$t $n\" > /tmp/n; sleep 0.2; done")


CREATE_A = ("--memory", "256MiB", "--volume", f"data={VOLUME}", "--mount", "data:/data",
            "--image", IMAGE, "--cmd", "/bin/sh", "-c", LOOP)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodNet]:
    with PodNet(tmp_path_factory.mktemp("podnet")) as node:
        yield node


@pytest.fixture
def pod_a(net: PodNet) -> str:
    """Pod A running its shell on the volume, made by the first test that needs it."""
    if net.ctl("volume", "get", VOLUME, check=False).returncode == 15:
        net.ctl("volume", "create", VOLUME, "--size", "128MiB")
    running_pod(net, A, *CREATE_A)
    return A


@pytest.fixture(scope="module")
def failing(net: PodNet) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The creates (with --wait) of the three pods that fail, started at once: their boots side
    by side. Each test waits for those it looks at."""
    missing = f"{REGISTRY_V4}:5000/feos/no-such-image:1"
    creates = {
        BAD_USER: net.ctl_popen("pod", "create", BAD_USER, "--wait", "--memory", "256MiB",
                                "--image", BAD_USER_IMAGE),
        BAD_IMAGE: net.ctl_popen("pod", "create", BAD_IMAGE, "--wait", "--memory", "256MiB",
                                 "--name", "web", "--image", missing, "--cmd", "sleep", "60"),
        BAD_CMD: net.ctl_popen("pod", "create", BAD_CMD, "--wait", "--memory", "256MiB",
                               "--image", IMAGE, "--cmd", "/bin/no-such-program"),
    }
    yield creates
    for create in creates.values():  # those a test selected alone did not wait for
        if create.poll() is None:
            create.kill()
        create.communicate(timeout=60)


def token_and_count(net: PodNet, pod_id: str) -> tuple[str, int]:
    token, count = net.exec(pod_id, "cat", "/tmp/n").stdout.split()
    return token, int(count)


def boot_id(net: PodNet, pod_id: str) -> str:
    return net.exec(pod_id, "cat", "/proc/sys/kernel/random/boot_id").stdout.strip()


def test_create_with_a_container_from_the_registry(net: PodNet) -> None:
    net.ctl("volume", "create", VOLUME, "--size", "128MiB")
    pod = net.ctl_json("pod", "create", A, "--wait", *CREATE_A)
    assert pod["state"] == "running", pod
    assert pod["reason"] == ""
    assert ipaddress.ip_address(pod["ipv6Address"]) in ipaddress.ip_network(PREFIX)
    assert ipaddress.ip_address(pod["ipv4Address"]) in ipaddress.ip_network(IPV4_RANGE)
    assert [(c["name"], c["state"]) for c in pod["containers"]] == [("main", "running")]
    assert f"pod-{A}" in net.links()
    assert A in net.qemus()
    volume = net.ctl_json("volume", "get", VOLUME)
    assert (volume["state"], volume["podId"], volume["formatted"]) == ("attached", A, True)


def test_get_shows_the_containers_states(net: PodNet, pod_a: str) -> None:
    table = net.ctl("pod", "get", A).stdout
    assert "container main" in table
    assert "running" in table.splitlines()[2]
    pod = net.ctl_json("pod", "get", A)
    main = pod["containers"][0]
    assert main["pid"] > 0 and main["startedUnixNs"] > 0 and main["finishedUnixNs"] == 0


def test_exec_gives_the_output_and_the_exit_code(net: PodNet, pod_a: str) -> None:
    hi = net.exec(A, "echo", "hi")
    assert (hi.returncode, hi.stdout, hi.stderr) == (0, "hi\n", "")
    failing = net.exec(A, "sh", "-c", "echo oops >&2; exit 3", check=False)
    assert (failing.returncode, failing.stdout, failing.stderr) == (3, "", "oops\n")
    # The image's environment, and the user's on top.
    env = net.ctl("pod", "exec", A, "--env", "GREETING=hello", "--", "sh", "-c",
                  "echo $FROM_IMAGE $GREETING").stdout
    assert env == "yes hello\n"
    # stdin passes through with -i
    fed = net.ctl("pod", "exec", A, "-i", "--", "wc", "-c", input="12345").stdout
    assert fed.split() == ["5"]
    missing = net.exec(A, "/bin/no-such-program", check=False)
    assert missing.returncode != 0


def test_logs_give_the_containers_output(net: PodNet, pod_a: str) -> None:
    assert net.ctl("pod", "logs", A).stdout == "started\n"


def test_the_guest_has_the_pods_addresses(net: PodNet, pod_a: str) -> None:
    pod = net.ctl_json("pod", "get", A)
    addr = net.exec(A, "ip", "addr", "show", "dev", "eth0").stdout
    assert f"inet {pod['ipv4Address']}/32" in addr
    assert f"inet6 {pod['ipv6Address']}/128" in addr
    v4 = net.exec(A, "ip", "-4", "route").stdout
    assert "default via 169.254.0.1 dev eth0" in v4
    v6 = net.exec(A, "ip", "-6", "route").stdout
    assert "fc00::/7 via fe80::1 dev eth0" in v6  # a ULA prefix: no default route over IPv6
    assert "default" not in v6
    assert net.exec(A, "cat", "/etc/resolv.conf").stdout.startswith("nameserver 169.254.0.53\n")


def test_the_pod_resolves_names_and_reaches_the_registry(net: PodNet, pod_a: str) -> None:
    # the node's resolver asks the upstream (dnsmasq in the internet namespace)
    found = net.exec(A, "busybox", "nslookup", REGISTRY_NAME)
    assert f"Address: {REGISTRY_V4}" in found.stdout
    # out through the node, masqueraded, to the registry
    got = net.exec(A, "busybox", "wget", "-q", "-O-", f"http://{REGISTRY_NAME}:5000/v2/")
    assert got.stdout == "{}"


def test_suspend_and_resume_keep_the_processes_memory(net: PodNet, pod_a: str) -> None:
    token, before = token_and_count(net, A)
    boot = boot_id(net, A)
    assert net.ctl_json("pod", "suspend", A)["state"] == "suspended"
    assert A not in net.qemus()  # the snapshot holds it now
    refused = net.exec(A, "echo", "hi", check=False)
    assert refused.returncode == 19 and "suspended, not running" in refused.stderr
    assert net.ctl_json("pod", "resume", A)["state"] == "running"
    again, after = token_and_count(net, A)
    assert again == token  # the same shell, its variable kept
    assert after >= before
    assert boot_id(net, A) == boot
    assert net.exec(A, "busybox", "wget", "-q", "-O-", f"http://{REGISTRY_V4}:5000/v2/").stdout == "{}"


def test_stop_and_start_keep_the_containers_files(net: PodNet, pod_a: str) -> None:
    token, _ = token_and_count(net, A)
    boot = boot_id(net, A)
    net.exec(A, "sh", "-c", "echo in-the-rootfs > /kept && echo on-the-volume > /data/f")
    stopped = net.ctl_json("pod", "stop", A)
    assert stopped["state"] == "stopped"
    assert A not in net.qemus()
    started = net.ctl_json("pod", "start", A, "--wait")
    assert started["state"] == "running"
    assert [(c["name"], c["state"]) for c in started["containers"]] == [("main", "running")]
    assert net.exec(A, "cat", "/kept", "/data/f").stdout == "in-the-rootfs\non-the-volume\n"
    assert boot_id(net, A) != boot  # booted anew ...
    assert token_and_count(net, A)[0] != token  # ... and the container's process started anew


def test_delete_frees_the_volume_for_a_second_pod(net: PodNet, pod_a: str) -> None:
    net.exec(A, "sh", "-c", "echo in-the-rootfs > /kept && echo on-the-volume > /data/f")
    pod = net.ctl_json("pod", "get", A)
    assert net.ctl("pod", "delete", A).stdout.strip() == f"pod {A} deleted"
    assert net.ctl("pod", "get", A, check=False).returncode == 15
    volume = net.ctl_json("volume", "get", VOLUME)
    assert (volume["state"], volume["podId"]) == ("available", "")
    assert A not in net.qemus()
    assert f"pod-{A}" not in net.links()
    assert records_gone(net.state_dir / "pods", f"{A}.pb")
    assert not (net.state_dir / "disk" / "disks" / A).exists()
    assert not (net.state_dir / "vms" / "qemu" / A).exists()

    second = net.ctl_json("pod", "create", B, "--wait", "--memory", "256MiB",
                          "--volume", f"store={VOLUME}", "--mount", "store:/store",
                          "--image", IMAGE, "--cmd", "sleep", "3600")
    assert second["state"] == "running"
    assert second["ipv6Address"] != pod["ipv6Address"]  # an IPv6 address is never handed out twice
    assert net.exec(B, "cat", "/store/f").stdout == "on-the-volume\n"
    assert not net.exec(B, "ls", "/kept", check=False).returncode == 0  # A's rootfs went with A
    assert net.ctl_json("volume", "get", VOLUME)["podId"] == B


def test_pods_that_fail_say_why(net: PodNet, failing: dict[str, subprocess.Popen[str]]) -> None:
    waits = [failing[BAD_USER], failing[BAD_IMAGE]]
    outs = [w.communicate(timeout=300) for w in waits]
    for w, (_, err) in zip(waits, outs, strict=True):
        assert w.returncode == 19, err
    bad_user = net.ctl_json("pod", "get", BAD_USER)
    assert bad_user["state"] == "failed"
    assert "container main" in bad_user["reason"]
    assert "no-such-user" in bad_user["reason"]
    bad_image = net.ctl_json("pod", "get", BAD_IMAGE)
    assert bad_image["state"] == "failed"
    assert "container web" in bad_image["reason"]
    assert "feos/no-such-image" in bad_image["reason"]
    assert f"failed: {bad_image['reason']}" in outs[1][1]
    listed = {p["id"]: p["state"] for p in net.ctl_json("pod", "list")}
    assert {listed.get(BAD_USER), listed.get(BAD_IMAGE)} == {"failed"}


def test_a_command_that_is_not_there_fails_the_pod_naming_it(
        net: PodNet, failing: dict[str, subprocess.Popen[str]]) -> None:
    # The guest looks the command up in the image's root at the container's create (as docker's
    # create does), so a program the image lacks fails the pod with the reason, rather than a
    # pod that runs a container that exited at once.
    done = failing[BAD_CMD]
    _, err = done.communicate(timeout=300)
    assert done.returncode == 19, err
    bad = net.ctl_json("pod", "get", BAD_CMD)
    assert bad["state"] == "failed"
    assert "container main" in bad["reason"]
    assert "'/bin/no-such-program' is not an executable file in image" in bad["reason"]


def test_deleting_every_pod_leaves_nothing(net: PodNet) -> None:
    if not net.ctl_json("pod", "list"):  # alone: a running pod, its TAP and rules, to delete
        running_pod(net, B, "--memory", "256MiB", "--image", IMAGE, "--cmd", "sleep", "3600")
    for pod in net.ctl_json("pod", "list"):
        net.ctl("pod", "delete", pod["id"])
    assert net.ctl_json("pod", "list") == []
    assert net.qemus() == {}
    assert not [name for name in net.links() if name.startswith("pod-")]
    assert records_gone(net.state_dir / "pods")
    # the pods' disks went with them; the volume's stays (it outlives its pods)
    assert {d.name for d in (net.state_dir / "disk" / "disks").glob("*")} <= {VOLUME}
    assert list((net.state_dir / "vms" / "qemu").glob("*")) == []
    table = subprocess.run(net.in_node("nft", "-j", "list", "table", "inet", "feos"),
                           capture_output=True, text=True, check=True).stdout
    chains = [c["chain"]["name"] for c in json.loads(table)["nftables"] if "chain" in c]
    assert not [c for c in chains if c.startswith(("out-", "in-"))]
