"""Hibernate and restore with real parts: two nodes, one object store, real QEMU guests.

Two nodes on this machine (integration/podnet.py: each a feosd and its diskd with state
directories and network namespaces of their own) and one moto S3 server both diskds use. In
order (each test also passes alone: `pod_on` makes what it needs):

1. pod H1, with a volume, whose container writes a file on its disk and on the volume and whose
   shell holds a token in its memory (and 64 MiB of random bytes in a tmpfs), hibernates on node
   A: A keeps nothing of it (no QEMU, no TAP, its volume CHECKPOINTED); RestorePod on node B
   brings it up with the same ID, the same process (its token), both files, new addresses of
   B's, reaching B's registry;
2. pod H2 on A: a Resume while its hibernation uploads abandons it (ABORTED), the pod runs on
   with its token (moto is stopped meanwhile, SIGSTOP: the upload waits while the test acts);
3. the same with --no-abandon: the Resume waits, the pod is hibernated and restored on A;
4. kill -9 of feosd, then of diskd, in the middle of H2's hibernation: the pod ends either on
   the node or hibernated with a whole checkpoint, and runs again with its token;
5. checkpoints refused with nothing left half made: a reference the store lacks (NOT_FOUND),
   a checkpoint whose bytes were changed (DATA_LOSS), one whose layer is gone (NOT_FOUND).

Two boots in all (H1, H2), side by side: H2's create starts with the module (`nodes`) and the
first test that needs H2 waits for it; the rest are QEMU loading snapshots.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from feosd_proc import running_pod
from moto_s3 import MotoS3, moto_s3
from podnet import IMAGE, REGISTRY_V4, PodNet

pytestmark = pytest.mark.integration

H1, H2 = "ha0000000aa", "hb0000000bb"
VOLUME = "7b2e1d4f-3c5e-4f9a-8b7d-6e4f3a2b1c0d"
# a token only the running shell holds, written out as it goes; 64 MiB of memory that is not
# zero (the snapshot has something to move)
LOOP = ("head -c 64M /dev/urandom > /dev/shm/fill 2>/dev/null; "
        "t=$(cat /proc/sys/kernel/random/uuid); n=0; "
        "while :; do n=$((n+1)); echo \"$t $n\" > /tmp/n; sleep 0.2; done")
CREATE = ("--memory", "512MiB", "--image", IMAGE, "--cmd", "/bin/sh", "-c", LOOP)
PHASE_WAIT_S = 120.0


@attrs.define
class Nodes:
    a: PodNet
    b: PodNet
    s3: MotoS3
    h2_create: subprocess.Popen[str] | None = None  # H2's create on A, started with the module

    def h2_on_a(self) -> str:
        """H2 running on A with its token (pod_on), once the module's create of it ended."""
        if self.h2_create is not None:
            create, self.h2_create = self.h2_create, None
            code, _, err = ended(create)
            assert code == 0, err
        return pod_on(self.a, H2)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("hibernate")
    with moto_s3(root) as s3:
        a, b = PodNet(root / "a"), PodNet(root / "b")
        for net in (a, b):
            net.feosd.diskd.env.update(s3.env())
        with a, b:
            # H2 boots beside H1 (the first test's): its create goes on while that test runs
            made = Nodes(a, b, s3, h2_create=a.ctl_popen("pod", "create", H2, "--wait", *CREATE))
            try:
                yield made
            finally:
                if made.h2_create is not None:  # no test waited for it
                    made.h2_create.kill()
                    made.h2_create.communicate(timeout=60)


def token(net: PodNet, pod_id: str) -> str:
    return net.exec(pod_id, "cat", "/tmp/n").stdout.split()[0]


def pod_on(net: PodNet, pod_id: str, *create: str) -> str:
    """The pod running on `net` with its token, whatever an earlier test left of it."""
    got = net.ctl("--json", "pod", "get", pod_id, check=False)
    if got.returncode == 0 and json.loads(got.stdout)["state"] == "hibernated":
        net.ctl_json("pod", "resume", pod_id, timeout=600)
    running_pod(net, pod_id, *(create or CREATE))
    deadline = time.monotonic() + 60
    while net.exec(pod_id, "cat", "/tmp/n", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the container's shell wrote no token"
        time.sleep(0.5)
    return token(net, pod_id)


@contextlib.contextmanager
def store_paused(s3: MotoS3) -> Iterator[None]:
    """moto stopped (SIGSTOP): its requests wait, within diskd's read timeout (10 s a try), so
    that a hibernation stays in its upload while the test acts; it goes on after."""
    os.kill(s3.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s3.pid, signal.SIGCONT)


def wait_phase(net: PodNet, pod_id: str, phases: tuple[str, ...]) -> dict[str, Any]:
    """The pod's hibernation once it is in one of `phases` (GetPod's progress)."""
    deadline = time.monotonic() + PHASE_WAIT_S
    while time.monotonic() < deadline:
        pod = net.ctl_json("pod", "get", pod_id)
        progress = pod.get("hibernation") or {}
        if progress.get("phase") in phases:
            return dict(progress)
        assert pod["state"] != "hibernated", "the hibernation ended before it was looked at"
        time.sleep(0.05)
    raise AssertionError(f"pod {pod_id} reached none of {phases} in {PHASE_WAIT_S:g}s")


def ended(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def test_hibernated_on_one_node_restored_on_the_other(nodes: Nodes) -> None:
    a, b = nodes.a, nodes.b
    if a.ctl("volume", "get", VOLUME, check=False).returncode == 15:
        a.ctl("volume", "create", VOLUME, "--size", "128MiB")
    before = pod_on(a, H1, "--volume", f"data={VOLUME}", "--mount", "data:/data", *CREATE)
    old = a.ctl_json("pod", "get", H1)
    a.exec(H1, "sh", "-c", "echo in-the-rootfs > /kept && echo on-the-volume > /data/f && sync")
    done = a.ctl("--json", "pod", "hibernate", H1, timeout=600)
    hibernated = json.loads(done.stdout)
    ref = hibernated["checkpoint"]
    assert hibernated["state"] == "hibernated" and ref.startswith("sha256:")
    assert H1 not in a.qemus()
    assert not any(H1 in link for link in a.links())
    assert not hibernated.get("ipv4Address")
    volume = a.ctl_json("volume", "get", VOLUME)
    assert volume["state"] == "checkpointed" and volume["checkpoint"].startswith("sha256:")

    restored = b.ctl_json("pod", "restore", H1, ref, timeout=600)
    assert (restored["id"], restored["state"]) == (H1, "running")
    assert token(b, H1) == before  # the same shell, its memory kept
    assert b.exec(H1, "cat", "/kept", "/data/f").stdout == "in-the-rootfs\non-the-volume\n"
    new = b.ctl_json("pod", "get", H1)
    assert new["ipv4Address"] and new["ipv6Address"]
    assert old["ipv6Address"]  # it had its own on A
    addresses = b.exec(H1, "ip", "addr", "show", "dev", "eth0").stdout
    assert f"inet {new['ipv4Address']}/32" in addresses  # the guest was told B's addresses
    got = b.exec(H1, "busybox", "wget", "-q", "-O-", f"http://{REGISTRY_V4}:5000/v2/")
    assert got.stdout == "{}"
    assert b.ctl_json("volume", "get", VOLUME)["state"] == "attached"


def test_a_resume_abandons_a_hibernation(nodes: Nodes) -> None:
    a = nodes.a
    before = nodes.h2_on_a()
    with store_paused(nodes.s3):
        hibernation = a.ctl_popen("pod", "hibernate", H2)
        try:
            wait_phase(a, H2, ("upload",))
            resumed = a.ctl_json("pod", "resume", H2, timeout=600)  # with the store stopped
        finally:
            os.kill(nodes.s3.pid, signal.SIGCONT)
            code, _, err = ended(hibernation)
    assert resumed["state"] == "running"
    assert code == 10 + 10 and "abandoned by a resume" in err, err  # ABORTED
    assert "seal" in err or "upload" in err  # its progress lines
    assert token(a, H2) == before
    assert not a.ctl_json("pod", "get", H2).get("checkpoint")


def test_no_abandon_makes_the_resume_wait_and_restore(nodes: Nodes) -> None:
    a = nodes.a
    before = nodes.h2_on_a()
    with store_paused(nodes.s3):
        hibernation = a.ctl_popen("--json", "pod", "hibernate", H2, "--no-abandon")
        try:
            progress = wait_phase(a, H2, ("upload",))
            assert progress["noAbandon"]
            resume = a.ctl_popen("--json", "pod", "resume", H2)
            time.sleep(3)
            assert resume.poll() is None  # it waits for the hibernation
        finally:
            os.kill(nodes.s3.pid, signal.SIGCONT)
            code, out, err = ended(hibernation)
    resumed_code, resumed_out, resumed_err = ended(resume)
    assert resumed_code == 0, resumed_err
    resumed = json.loads(resumed_out)
    assert code == 0, err
    assert json.loads(out)["state"] == "hibernated"
    assert resumed["state"] == "running"
    assert token(a, H2) == before


@pytest.mark.parametrize("kill", ["feosd", "diskd"])
def test_kill_9_mid_hibernation_ends_on_the_node_or_hibernated(nodes: Nodes, kill: str) -> None:
    a = nodes.a
    before = nodes.h2_on_a()
    with store_paused(nodes.s3):
        hibernation = a.ctl_popen("pod", "hibernate", H2)
        try:
            wait_phase(a, H2, ("upload",))
            if kill == "feosd":
                a.kill_feosd()
            else:
                a.feosd.diskd.kill()
        finally:
            os.kill(nodes.s3.pid, signal.SIGCONT)
            if kill == "feosd":
                a.start_feosd()
            else:
                a.feosd.start_diskd()  # feosd waits for it, and asks again
            ended(hibernation)
    deadline = time.monotonic() + 300
    pod = a.ctl_json("pod", "get", H2)
    while pod.get("hibernation") and time.monotonic() < deadline:
        time.sleep(0.2)  # a hibernation that went on with a diskd started again
        pod = a.ctl_json("pod", "get", H2)
    assert pod["state"] in ("running", "suspended", "hibernated"), pod
    if pod["state"] == "hibernated":
        assert pod["checkpoint"].startswith("sha256:")
    if pod["state"] != "running":
        assert a.ctl_json("pod", "resume", H2, timeout=600)["state"] == "running"
    assert token(a, H2) == before


def test_bad_checkpoints_are_refused_leaving_nothing(nodes: Nodes) -> None:
    a, b = nodes.a, nodes.b
    nodes.h2_on_a()
    ref = a.ctl_json("pod", "hibernate", H2, timeout=600)["checkpoint"]
    client = nodes.s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=nodes.s3.bucket)["Contents"]]
    key = next(k for k in keys if k.endswith(f"checkpoints/{ref.removeprefix('sha256:')}.json"))
    good = client.get_object(Bucket=nodes.s3.bucket, Key=key)["Body"].read()
    checkpoint = json.loads(good)

    missing = b.ctl("pod", "restore", H2, "sha256:" + "0" * 64, check=False)
    assert missing.returncode == 15, missing.stderr  # NOT_FOUND
    try:
        client.put_object(Bucket=nodes.s3.bucket, Key=key, Body=good.replace(b"512", b"513"))
        damaged = b.ctl("pod", "restore", H2, ref, check=False)
        assert damaged.returncode == 25 and "digest" in damaged.stderr, damaged.stderr  # DATA_LOSS
        client.put_object(Bucket=nodes.s3.bucket, Key=key, Body=good)
        layer = checkpoint["disk"].removeprefix("sha256:")
        manifest = next(k for k in keys if k.endswith(f"layers/{layer}.json"))
        saved = client.get_object(Bucket=nodes.s3.bucket, Key=manifest)["Body"].read()
        client.delete_object(Bucket=nodes.s3.bucket, Key=manifest)
        partial = b.ctl("pod", "restore", H2, ref, check=False)
        assert partial.returncode == 15 and layer in partial.stderr, partial.stderr
        client.put_object(Bucket=nodes.s3.bucket, Key=manifest, Body=saved)
    finally:
        client.put_object(Bucket=nodes.s3.bucket, Key=key, Body=good)
    assert b.ctl("pod", "get", H2, check=False).returncode == 15  # nothing of it on B
    assert H2 not in b.qemus()
    disks = b.feosd.diskd.call("listDisks").get("disks", [])
    assert not [d for d in disks if d.get("id") == H2], disks
