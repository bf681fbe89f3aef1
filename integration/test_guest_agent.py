"""The agent in a real guest under QEMU, driven from the node's side as feosd drives it.

One VM for the module: the installed guest image (hack/guest-image builds it if the agent
changed), its data disk and one volume disk, and a TAP device for its network. The guest reaches
a registry of the test's and nothing else: QEMU opens the TAP in the host's namespace, then the
test moves it into a network namespace of its own, where the registry (and a proxy that demands
a Bearer token) listen on 169.254.0.1, the pods' IPv4 gateway. No packet leaves that namespace.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import capnp
import pytest
from guestvm import Guest, GuestVM

from feos.errors import Code, FeosError
from feos.guestlink import ContainerConfig, GuestClient, NetworkConfig, VolumeMount, VolumeSpec
from feos.vmm._qemu_argv import Tap

REPO = Path(__file__).resolve().parent.parent
GATEWAY = "169.254.0.1"
POD_IPV4 = "169.254.16.5"
POD_IPV6 = "fd00:1::5"
VOLUME_BYTES = 64 << 20


def _load_registry_helpers() -> ModuleType:
    path = REPO / "tests" / "unit" / "test_guest_registry.py"
    spec = importlib.util.spec_from_file_location("_guest_registry_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reg = _load_registry_helpers()


def sh(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class Env:
    def __init__(self, vm: GuestVM, mac: str, ns: str, token: str) -> None:
        self.vm, self.mac, self.ns, self.token = vm, mac, ns, token

    def run(self, scenario: Callable[[GuestClient], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            async with await GuestClient.connect(str(self.vm.link_path), deadline=30) as client:
                return await scenario(client)

        return asyncio.run(capnp.run(main()))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("guest-agent")
    built = subprocess.run([str(REPO / "hack/guest-image")], check=True, text=True,
                           stdout=subprocess.PIPE, timeout=1200).stdout  # fmt: skip
    guest = Guest.at(built.strip().splitlines()[-1])
    ns = f"feostest-ga-{secrets.token_hex(3)}"
    tap = f"feostap{secrets.token_hex(3)}"
    mac = "06:00:" + ":".join(secrets.token_hex(1) for _ in range(4))
    procs: list[subprocess.Popen[bytes]] = []
    vm = None
    sh("ip", "netns", "add", ns)
    try:
        enter = ["nsenter", f"--net=/run/netns/{ns}"]
        sh(*enter, "ip", "link", "set", "lo", "up")
        # The image goes into the registry's storage through a registry on the host's loopback;
        # the one the guest reaches then serves that storage inside the namespace.
        storage = work / "registry"
        storage.mkdir()
        pusher = reg.Registry(str(storage))
        reg.push_busybox(pusher.host)
        pusher.close()
        (storage / "ns.yml").write_text(
            (storage / "config.yml")
            .read_text()
            .replace(f"127.0.0.1:{pusher.port}", f"{GATEWAY}:5000")
        )
        sh("ip", "tuntap", "add", "dev", tap, "mode", "tap")
        volume = work / "vol1.img"
        with open(volume, "wb") as f:
            f.truncate(VOLUME_BYTES)
        vm = GuestVM.boot(guest, work / "vm", volumes=[volume], tap=Tap(tap, mac), timeout=900)
        vm.wait_console("FEOS-INIT: starting the agent", timeout=120)
        sh("ip", "link", "set", tap, "netns", ns)  # QEMU holds it open: it follows
        for cmd in (("link", "set", tap, "up"), ("addr", "add", f"{GATEWAY}/32", "dev", tap),
                    ("route", "add", f"{POD_IPV4}/32", "dev", tap)):  # fmt: skip
            sh(*enter, "ip", *cmd)
        procs.append(subprocess.Popen([*enter, "docker-registry", "serve", str(storage / "ns.yml")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        procs.append(subprocess.Popen(
            [*enter, sys.executable, str(REPO / "tests/unit/test_guest_registry.py"),
             f"{GATEWAY}:5000", GATEWAY, "5001"], stdout=subprocess.DEVNULL))  # fmt: skip
        _wait_listening(enter, (5000, 5001))
        yield Env(vm, mac, ns, reg.TOKEN)
    finally:
        if vm is not None:
            vm.kill()
        for p in procs:
            p.terminate()
            p.wait(10)
        sh("ip", "netns", "delete", ns, check=False)
        sh("ip", "link", "delete", tap, check=False)


def _wait_listening(enter: list[str], ports: tuple[int, ...]) -> None:
    probe = "import socket,sys\nfor p in sys.argv[1:]: socket.create_connection(('%s', int(p)), 1)"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        cmd = [*enter, sys.executable, "-c", probe % GATEWAY, *map(str, ports)]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the registry and its proxy did not listen in the namespace")


def test_ping_attach_and_the_clock(env: Env) -> None:
    async def scenario(c: GuestClient) -> dict[str, Any]:
        ping = await c.ping()
        attached = await asyncio.wait_for(c.attached, 10)
        out: dict[str, Any] = {"ping": ping, "attached": attached}
        base = time.time_ns()
        await c.set_time(base + 3600 * 10**9)
        out["stepped"] = await c.get_time() - time.time_ns()
        await c.set_time(time.time_ns())
        out["slewed"] = await c.adjust_time(20_000_000)  # 20 ms: slewed
        before = await c.get_time() - time.time_ns()
        out["big_step"] = await c.adjust_time(2 * 10**9)  # 2 s: stepped
        out["after_step"] = await c.get_time() - time.time_ns() - before
        await c.set_time(time.time_ns())
        return out

    got = env.run(scenario)
    assert got["ping"].boot_id == got["attached"].boot_id
    assert abs(got["stepped"] - 3600 * 10**9) < 5 * 10**9
    assert got["slewed"] is True
    assert got["big_step"] is False
    assert abs(got["after_step"] - 2 * 10**9) < 10**9


def test_network_volume_pull_and_a_container(env: Env) -> None:
    image = f"{GATEWAY}:5000/feos/busybox:1"

    async def scenario(c: GuestClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        await c.configure_network(
            NetworkConfig(POD_IPV6, POD_IPV4, ("169.254.0.53",), 1420, env.mac)
        )
        out["volumes"] = await c.mount_volumes([VolumeSpec("store", 1, VOLUME_BYTES, True, "v-1")])
        with pytest.raises(FeosError) as refused:
            await c.pull_image(f"{GATEWAY}:5001/feos/busybox:1", "not-the-token")
        out["refused"] = refused.value
        out["authorized"] = await c.pull_image(f"{GATEWAY}:5001/feos/busybox:1", env.token)
        with pytest.raises(FeosError) as missing:
            await c.create_container(ContainerConfig("bad", image, ("no-such-program", "x")))
        out["missing"] = missing.value
        config = ContainerConfig(
            "web", image, ("/bin/sh", "-c", "echo started; echo kept > /store/f; sleep 600"),
            env=("GREETING=hi",), volume_mounts=(VolumeMount("store", "/store"),),
        )  # fmt: skip
        out["created"] = await c.create_container(config)
        out["started"] = await c.start_container("web")
        for _ in range(300):
            if await (await c.logs("web")).read_all():
                break
            await asyncio.sleep(0.1)
        out["logs"] = await (await c.logs("web")).read_all()
        out["echo"] = await (
            await c.exec("web", ["/bin/sh", "-c", "echo $GREETING; exit 7"])
        ).communicate()
        out["ip"] = await (await c.exec("web", ["ip", "addr", "show"])).communicate()
        out["route"] = await (await c.exec("web", ["ip", "-6", "route", "show"])).communicate()
        out["resolv"] = await (
            await c.exec("web", ["cat", "/etc/resolv.conf", "/store/f"])
        ).communicate()
        out["list"] = await c.list_containers()
        out["stopped"] = await c.stop_container("web", timeout_ms=3000)
        await c.delete_container("web")
        out["after"] = await c.list_containers()
        return out

    got = env.run(scenario)
    assert [(o.name, o.mounted, o.error) for o in got["volumes"]] == [("store", True, "")]
    assert got["refused"].code == Code.UNAUTHENTICATED
    assert "401 Unauthorized" in got["refused"].message
    assert "not-the-token" not in got["refused"].message
    assert got["authorized"][0].startswith("sha256:")
    assert got["missing"].code == Code.INVALID_ARGUMENT
    assert "'no-such-program' is not an executable file in its PATH" in got["missing"].message
    assert got["created"].status == "created"
    assert got["started"].status == "running"
    assert got["logs"] == b"started\n"
    assert (got["echo"].exit_code, got["echo"].stdout) == (7, b"hi\n"), got["echo"]
    ip = got["ip"].stdout.decode()
    assert f"inet {POD_IPV4}/32" in ip
    assert f"inet6 {POD_IPV6}/128" in ip
    assert "mtu 1420" in ip
    assert "fc00::/7 via fe80::1" in got["route"].stdout.decode()
    assert got["resolv"].stdout == b"nameserver 169.254.0.53\noptions edns0\nkept\n"
    assert [s.name for s in got["list"]] == ["web"]
    assert got["stopped"].status == "stopped"
    assert got["after"] == []


def test_freeze_thaw_and_prepare_suspend(env: Env) -> None:
    async def scenario(c: GuestClient) -> tuple[int, int]:
        await c.freeze_filesystem()
        await c.ping()  # the agent answers while /data is frozen
        await c.thaw_filesystem()
        return await c.prepare_suspend()

    before, after = env.run(scenario)
    assert before > 0 and after > 0


def test_shutdown_powers_the_guest_off(env: Env) -> None:
    env.run(lambda c: c.shutdown())
    assert env.vm.wait_exit(60) == 0
    assert "shutting down" in env.vm.console()
