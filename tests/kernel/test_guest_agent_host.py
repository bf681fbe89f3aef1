"""The agent on the host as root: crun containers, a volume on a loop device, the data volume's
freeze, and the network configuration of a TAP device.

The agent runs in a network namespace of the test's (ip netns exec), with a TAP device there and
the registry on that namespace's loopback, so its pulls and its ip(8) commands stay inside; its
data directory is an ext4 loop mount of its own, so a freeze touches nothing else.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import Netns, run
from feos.errors import Code, FeosError
from feos.guestlink import ContainerConfig, GuestClient, NetworkConfig, VolumeMount, VolumeSpec

UNIT = Path(__file__).resolve().parent.parent / "unit"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_guest_{name}", UNIT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


service = _load("test_guest_service")
registries = _load("test_guest_registry")


class LoopFs:
    """An ext4 image on a loop device, mounted at a directory; undone by close()."""

    def __init__(self, image: Path, mountpoint: Path | None, size_mib: int = 64) -> None:
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        self.device = run("losetup", "--find", "--show", str(image)).stdout.strip()
        self.mountpoint = mountpoint
        if mountpoint is not None:
            run("mkfs.ext4", "-q", "-F", self.device)
            mountpoint.mkdir(parents=True, exist_ok=True)
            run("mount", self.device, str(mountpoint))

    def close(self) -> None:
        if self.mountpoint is not None:
            run("fsfreeze", "--unfreeze", str(self.mountpoint), check=False)
            run("umount", "-l", str(self.mountpoint), check=False)
        run("losetup", "-d", self.device, check=False)


class Umount:
    def __init__(self, path: Path) -> None:
        self.path = path

    def close(self) -> None:
        run("umount", "-l", str(self.path), check=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("agent-host")
    ns = Netns(f"feostest-guest-{os.getpid() % 100000}")
    run("ip", "netns", "add", ns.name)
    made: list[Any] = []
    agent = None
    try:
        ns.run("ip", "link", "set", "lo", "up")
        ns.run("ip", "tuntap", "add", "dev", "feostap0", "mode", "tap")
        mac = ns.run("cat", "/sys/class/net/feostap0/address").stdout.strip()
        data = LoopFs(root / "data.img", root / "data")
        made.append(data)
        vol = LoopFs(root / "vol1.img", None, size_mib=64)
        made.append(vol)
        # The registry listens in the namespace, on its loopback: the agent's pulls stay there.
        reg_dir = root / "registry"
        reg_dir.mkdir()
        reg = registries.Registry(str(reg_dir))  # on the host first, to push the image
        digest = registries.push_busybox(reg.host)
        reg.close()
        port = registries.free_port()
        (reg_dir / "ns.yml").write_text(
            (reg_dir / "config.yml").read_text().replace(f":{reg.port}'", f":{port}'")
        )
        reg_proc = ns.popen("docker-registry", "serve", str(reg_dir / "ns.yml"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        made.append(reg_proc)
        # nsenter, not ip netns exec: that one remounts /sys, which takes crun's cgroups away.
        # The namespace's own devices are seen in a sysfs mounted from inside it.
        # In a mount namespace of its own, /sys/fs/cgroup is the cgroup2 tree alone, as in the
        # guest: crun 1.8 refuses this host's hybrid layout (hugetlb on the v2 tree).
        enter = [
            "nsenter",
            f"--net=/run/netns/{ns.name}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t cgroup2 cgroup2 /sys/fs/cgroup && exec "$@"',
            "sh",
        ]
        (root / "netsys").mkdir()
        run(
            "nsenter",
            f"--net=/run/netns/{ns.name}",
            "mount",
            "-t",
            "sysfs",
            "sysfs",
            str(root / "netsys"),
        )
        made.append(Umount(root / "netsys"))
        agent = service.AgentProcess(
            str(root), "--data", str(root / "data"), "--drive", f"1={vol.device}",
            "--sys-net", str(root / "netsys" / "class" / "net"),
            "--crun-cgroups", "disabled", prefix=enter,  # nor may it make cgroups here
        )  # fmt: skip
        _wait_in_ns(ns, port)
        yield {"agent": agent, "ns": ns, "mac": mac, "image": f"127.0.0.1:{port}/feos/busybox:1",
               "digest": digest, "root": root, "vol": vol}  # fmt: skip
    finally:
        if agent is not None:
            agent.close()
            run("sh", "-c", f"crun --root {root}/crun list -q | xargs -r -n1 crun --root {root}/crun delete -f",
                check=False)  # fmt: skip
        run("umount", "-l", str(root / "volumes" / "v1"), check=False)
        for thing in reversed(made):
            if isinstance(thing, subprocess.Popen):
                thing.terminate()
                thing.wait(10)
            else:
                thing.close()
        run("ip", "netns", "delete", ns.name, check=False)


def _wait_in_ns(ns: Netns, port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"
        if ns.run(sys.executable, "-c", probe, check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the registry did not listen in the namespace")


def test_network_configuration_reaches_the_device(setup: dict[str, Any]) -> None:
    ns, mac = setup["ns"], setup["mac"]

    async def scenario(c: GuestClient) -> None:
        await c.configure_network(
            NetworkConfig("fd00:1::5", "169.254.16.5", ("169.254.0.53",), 1420, mac)
        )

    setup["agent"].run(scenario)
    addrs = ns.run("ip", "addr", "show", "dev", "feostap0").stdout
    assert "inet 169.254.16.5/32" in addrs and "inet6 fd00:1::5/128" in addrs
    routes6 = ns.run("ip", "-6", "route", "show", "dev", "feostap0").stdout
    assert "fc00::/7 via fe80::1" in routes6 and "default" not in routes6
    routes4 = ns.run("ip", "-4", "route", "show", "dev", "feostap0").stdout
    assert "default via 169.254.0.1" in routes4 and "onlink" in routes4
    assert "mtu 1420" in ns.run("ip", "link", "show", "feostap0").stdout
    resolv = (setup["root"] / "run" / "resolv.conf").read_text()
    assert "nameserver 169.254.0.53" in resolv

    async def again(c: GuestClient) -> None:  # a global address now: a default route, no fc00::/7
        await c.configure_network(NetworkConfig("2001:db8::5", "", (), 0, mac))

    setup["agent"].run(again)
    routes6 = ns.run("ip", "-6", "route", "show", "dev", "feostap0").stdout
    assert "default via fe80::1" in routes6 and "fc00::/7" not in routes6
    assert "169.254.16.5" not in ns.run("ip", "addr", "show", "dev", "feostap0").stdout


def test_a_volume_is_formatted_and_mounted_once(setup: dict[str, Any]) -> None:
    size = 64 << 20

    async def scenario(c: GuestClient) -> list[Any]:
        wrong = await c.mount_volumes([VolumeSpec("v1", 1, size + 1, True)])
        first = await c.mount_volumes([VolumeSpec("v1", 1, size, True)])
        again = await c.mount_volumes([VolumeSpec("v1", 1, size, False)])
        return [wrong, first, again]

    wrong, first, again = setup["agent"].run(scenario)
    assert not wrong[0].mounted and "bytes, not" in wrong[0].error
    assert first[0].mounted and again[0].mounted, (first, again)
    mounts = Path(f"/proc/{setup['agent'].proc.pid}/mounts").read_text()  # its own namespace
    assert f"{setup['vol'].device} {setup['root']}/volumes/v1 ext4" in mounts


def test_a_container_runs_and_keeps_its_state(setup: dict[str, Any]) -> None:
    agent = setup["agent"]
    config = ContainerConfig(
        "web", setup["image"], ("/bin/sh", "-c", "echo out; echo err >&2; echo hi > /srv/f; sleep 300"),
        env=("GREETING=hello",), volume_mounts=(VolumeMount("v1", "/srv"),),
    )  # fmt: skip

    async def scenario(c: GuestClient) -> dict[str, Any]:
        created = await c.create_container(config)
        assert created.status == "created" and created.image_digest == setup["digest"]
        assert (await c.create_container(config)).created_ns == created.created_ns  # found
        with pytest.raises(FeosError) as e:
            await c.create_container(ContainerConfig("web", setup["image"], ("true",)))
        assert e.value.code == Code.ALREADY_EXISTS
        started = await c.start_container("web")
        assert started.status == "running" and started.pid > 0
        out = b""
        for _ in range(100):
            out = await (await c.logs("web")).read_all()
            if out:
                break
            await asyncio.sleep(0.1)
        err = await (await c.logs("web", "stderr")).read_all()
        state = await c.container_state("web")
        assert state.status == "running", (state, out, err)
        proc = await c.exec(
            "web", ["/bin/sh", "-c", "echo $GREETING $FROM_IMAGE; cat /etc/resolv.conf; exit 3"]
        )
        result = await proc.communicate()
        cat = await c.exec("web", ["/bin/cat"], stdin=True)
        await cat.write_stdin(b"through stdin")
        await cat.close_stdin()
        piped = await cat.communicate()
        return {"out": out, "err": err, "exec": result, "piped": piped}

    got = agent.run(scenario)
    assert got["out"] == b"out\n" and got["err"] == b"err\n"
    assert got["exec"].exit_code == 3
    assert got["exec"].stdout.startswith(b"hello yes\n"), got["exec"]
    assert got["piped"].stdout == b"through stdin" and got["piped"].exit_code == 0
    seen = Path(f"/proc/{agent.proc.pid}/root{setup['root']}/volumes/v1/f")
    assert seen.read_text() == "hi\n"

    # The agent restarts (not the machine): it finds the container running and adopts it.
    agent.proc.kill()  # SIGTERM would be a shutdown, which stops the containers
    agent.proc.wait(10)
    # The killed agent's last connection waits in the listener's backlog: a new listener.
    agent.listener.close()
    os.unlink(agent.sock_path)
    agent.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.listener.bind(agent.sock_path)
    agent.listener.listen(8)
    agent.proc = subprocess.Popen(agent.proc.args, stdout=agent.log, stderr=subprocess.STDOUT)

    async def after_restart(c: GuestClient) -> tuple[Any, Any, Any, list[Any]]:
        kept = await c.container_state("web")
        follow = await c.logs("web", follow=True)
        assert await follow.read() == b"out\n"
        stopped = await c.stop_container("web", timeout_ms=2000)
        assert await follow.read() == b""  # the end: the container stopped
        again = await c.start_container("web")
        gone = await c.stop_container("web", 9, 1000)
        await c.delete_container("web")
        return kept, stopped, (again, gone), await c.list_containers()

    kept, stopped, (again, gone), left = agent.run(after_restart)
    assert kept.status == "running" and kept.pid > 0
    assert stopped.status == "stopped" and stopped.finished_ns > 0
    assert again.status == "running" and gone.status == "stopped" and gone.exit_code == 137
    assert left == []
    assert not (setup["root"] / "data" / "containers" / "web").exists()


def test_freeze_and_thaw_of_the_data_volume(setup: dict[str, Any]) -> None:
    data = setup["root"] / "data"

    async def scenario(c: GuestClient) -> None:
        await c.freeze_filesystem()
        await c.freeze_filesystem()  # frozen already: found
        # A write to a frozen filesystem waits: a child that writes does not end until the thaw.
        writer = subprocess.Popen(["sh", "-c", f"echo x > {data}/during-freeze"])  # noqa: ASYNC220
        await asyncio.sleep(0.5)
        assert writer.poll() is None
        await c.thaw_filesystem()
        await c.thaw_filesystem()  # thawed already: found
        assert await asyncio.get_running_loop().run_in_executor(None, writer.wait, 10) == 0
        await c.ping()

    setup["agent"].run(scenario)
    assert (data / "during-freeze").read_text() == "x\n"


def test_exec_runs_as_the_container_does(setup: dict[str, Any]) -> None:
    """exec as docker exec: the container's working directory and environment (the image's and
    the config's), each overridden by the call's, and a terminal of the size asked for."""
    config = ContainerConfig("shell", setup["image"], ("/bin/sleep", "300"),
                             env=("FROM_SPEC=spec",), working_dir="/tmp")  # fmt: skip
    show = ["/bin/sh", "-c", "pwd; echo $FROM_IMAGE $FROM_SPEC"]
    terminal = ["/bin/sh", "-c", "test -t 0 && test -t 1 && echo tty; busybox stty size; busybox tty"]

    async def scenario(c: GuestClient) -> dict[str, Any]:
        await c.create_container(config)
        await c.start_container("shell")
        try:
            plain = await (await c.exec("shell", show)).communicate()
            over = await (await c.exec("shell", show, ["FROM_SPEC=call"],
                                       working_dir="/proc")).communicate()  # fmt: skip
            tty = await (await c.exec("shell", terminal, tty=True, rows=33, cols=101)).communicate()
            small = await (await c.exec("shell", terminal, tty=True)).communicate()
            cat = await c.exec("shell", ["/bin/cat"], stdin=True, tty=True)
            await cat.write_stdin(b"typed\n")
            await cat.close_stdin()  # ^D on the terminal: cat's input ends
            typed = await cat.communicate()
        finally:
            await c.delete_container("shell")
        return {"plain": plain, "over": over, "tty": tty, "small": small, "typed": typed}

    got = setup["agent"].run(scenario)
    assert got["plain"].stdout == b"/tmp\nyes spec\n", got["plain"]
    assert got["over"].stdout == b"/proc\nyes call\n", got["over"]
    assert got["tty"].stdout.split(b"\r\n")[:2] == [b"tty", b"33 101"], got["tty"]
    assert got["tty"].stdout.split(b"\r\n")[2].startswith(b"/dev/pts/"), got["tty"]
    assert got["tty"].exit_code == 0 and got["tty"].stderr == b""
    assert got["small"].stdout.split(b"\r\n")[1] == b"24 80", got["small"]
    assert b"typed" in got["typed"].stdout and got["typed"].exit_code == 0, got["typed"]


def test_a_terminal_has_its_size_before_the_process_runs(setup: dict[str, Any]) -> None:
    """crun sets an exec's terminal size in its parent while its child already runs the
    process: a process asking for its size at once saw 0 x 0 now and then, until the agent held
    it at a gate until the size is set. Many execs in a row, each asking at once; and the
    gate's fds are closed before the process runs."""
    config = ContainerConfig("sizes", setup["image"], ("/bin/sleep", "300"))
    asks = ["/bin/busybox", "stty", "size"]

    async def scenario(c: GuestClient) -> dict[str, Any]:
        await c.create_container(config)
        await c.start_container("sizes")
        try:
            sizes = [await (await c.exec("sizes", asks, tty=True, rows=33, cols=101)).communicate()
                     for _ in range(40)]  # fmt: skip
            fds = await (await c.exec("sizes", ["/bin/sh", "-c", "ls /proc/$$/fd; true"],
                                      tty=True)).communicate()  # fmt: skip
        finally:
            await c.delete_container("sizes")
        return {"sizes": sizes, "fds": fds}

    got = setup["agent"].run(scenario)
    assert [r.stdout for r in got["sizes"]] == [b"33 101\r\n"] * 40, got["sizes"]
    assert got["fds"].stdout.split() == [b"0", b"1", b"2"], got["fds"]
