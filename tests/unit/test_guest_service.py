"""The agent as a process on the host, driven through the node's client over a Unix socket.

The agent runs with its state in tmp_path and its /sys lookups pointed at empty directories, so
no request reaches the host's drives or network; nothing here sets the clock or freezes a
filesystem (the kernel and integration tiers do, on filesystems and guests of their own).
The kernel tier imports AgentProcess.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import capnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.guest import node_poke
from feos.guestlink import ContainerConfig, GuestClient, NetworkConfig, VolumeMount, VolumeSpec

NO_DEVICE_MAC = "02:fe:05:00:00:01"


class AgentProcess:
    """`python -m feos.guest` dialing a Unix socket that the test listens on (as v.sock_10001)."""

    def __init__(
        self,
        root: str,
        *extra: str,
        link: str = "",
        pass_fds: tuple[int, ...] = (),
        prefix: list[str] | None = None,
    ) -> None:
        self.root = root
        self.sock_path = os.path.join(root, "v.sock_10001")
        for d in ("data", "run", "volumes", "crun", "sys-block", "sys-net"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not link:
            self.listener.bind(self.sock_path)
            self.listener.listen(8)
        self.log_path = os.path.join(root, "agent.log")
        self.log = open(self.log_path, "wb")
        argv = [
            sys.executable,
            "-m",
            "feos.guest",
            "--link",
            link or f"unix:{self.sock_path}",
            "--data",
            f"{root}/data",
            "--run",
            f"{root}/run",
            "--volumes",
            f"{root}/volumes",
            "--crun-root",
            f"{root}/crun",
            "--sys-block",
            f"{root}/sys-block",
            "--sys-net",
            f"{root}/sys-net",
            "--resolv-conf",
            f"{root}/run/resolv.conf",
            *extra,
        ]
        self.proc = subprocess.Popen(
            [*(prefix or []), *argv], stdout=self.log, stderr=subprocess.STDOUT, pass_fds=pass_fds
        )

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def run(self, scenario: Callable[[GuestClient], Awaitable[Any]]) -> Any:
        """Runs scenario(client) in one session, on an asyncio loop of its own."""

        async def main() -> Any:
            client = await GuestClient.accept(self.listener, deadline=10)
            try:
                return await scenario(client)
            finally:
                await client.close()

        return asyncio.run(capnp.run(main()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.listener.close()
        self.log.close()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = AgentProcess(str(tmp_path_factory.mktemp("agent")))
    try:
        yield a
    finally:
        a.close()
        assert "Traceback" not in a.output(), a.output()


async def status_of(call: Awaitable[Any]) -> Code:
    try:
        await call
    except FeosError as e:
        return e.code
    return Code.OK


def test_ping_attach_and_time(agent: AgentProcess) -> None:
    async def scenario(c: GuestClient) -> None:
        ping = await c.ping()
        assert ping.boot_id == c.boot_id
        assert ping.uptime_ns > 0
        attached = await asyncio.wait_for(c.attached, 5)
        assert (attached.session, attached.boot_id) == (c.session, c.boot_id)
        before = await c.get_time()
        assert abs(before - __import__("time").time_ns()) < 5_000_000_000
        assert await status_of(c.set_time(0)) == Code.INVALID_ARGUMENT

    agent.run(scenario)


def test_each_session_has_its_own_hello(agent: AgentProcess) -> None:
    first = agent.run(lambda c: asyncio.sleep(0, c.session))
    second = agent.run(lambda c: asyncio.sleep(0, c.session))
    assert first != second


def test_bad_requests_get_clear_statuses(agent: AgentProcess) -> None:
    async def scenario(c: GuestClient) -> None:
        with pytest.raises(FeosError) as e:
            await c.container_state("No_Such")
        assert e.value.code == Code.INVALID_ARGUMENT
        assert "name" in e.value.message
        with pytest.raises(FeosError) as e:
            await c.container_state("nothing")
        assert e.value.code == Code.NOT_FOUND
        bad = ContainerConfig(
            name="x", image="busybox", volume_mounts=(VolumeMount("v", "/a/../b"),)
        )
        with pytest.raises(FeosError) as e:
            await c.create_container(bad)
        assert e.value.code == Code.INVALID_ARGUMENT
        assert "volumeMounts[0].path" in e.value.message
        with pytest.raises(FeosError) as e:
            await c.configure_network(NetworkConfig(ipv6="not-an-address"))
        assert e.value.message == "config.ipv6: an IPv6 address"
        with pytest.raises(FeosError) as e:
            await c.configure_network(NetworkConfig(ipv4="169.254.16.5", mac=NO_DEVICE_MAC))
        assert e.value.code == Code.FAILED_PRECONDITION
        outcomes = await c.mount_volumes([VolumeSpec("v1", 1, 64 << 20, True)])
        assert [(o.name, o.mounted) for o in outcomes] == [("v1", False)]
        assert "no drive 1" in outcomes[0].error
        with pytest.raises(FeosError) as e:
            await c.mount_volumes([VolumeSpec("v1", 1, 0, True), VolumeSpec("v1", 2, 0, True)])
        assert e.value.message == "volumes: each name once"
        with pytest.raises(FeosError) as e:
            await c.exec("nothing", ["true"])
        assert e.value.code == Code.NOT_FOUND

    agent.run(scenario)


def test_a_poke_starts_a_new_session_on_the_same_stream(tmp_path: Any) -> None:
    """A node that finds the agent in a session it cannot use (after a resume) pokes it."""
    ours, theirs = socket.socketpair()
    a = AgentProcess(str(tmp_path), link=f"fd:{theirs.fileno()}", pass_fds=(theirs.fileno(),))
    theirs.close()

    async def main() -> tuple[str, str, str]:
        from feos.guest import Link

        link = Link(ours)
        first = await GuestClient._start(link)
        await first.ping()
        # The node forgets the session without a word: the agent still thinks it is live.
        assert first._pump is not None
        first._pump.cancel()
        await asyncio.gather(first._pump, return_exceptions=True)
        first._server.close()
        second = await GuestClient._start(Link(ours))  # no hello comes: it pokes
        ping = await second.ping()
        # A poke mid-session from the node's side too: the session ends, the client says so.
        await second._link.send(node_poke("again"))  # type: ignore[union-attr]
        await asyncio.wait_for(second.ended.wait(), 5)
        assert await status_of(second.ping()) == Code.UNAVAILABLE
        await second.close()
        return first.session, second.session, ping.boot_id

    try:
        s1, s2, boot = asyncio.run(capnp.run(main()))
        assert s1 != s2
        assert boot
        assert "the node poked" in a.output()
    finally:
        a.close()


def test_connect_deadline_is_unavailable(tmp_path: Any) -> None:
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    async def main() -> FeosError:
        with pytest.raises(FeosError) as e:
            await GuestClient.connect(path, deadline=0.5)
        return e.value

    try:
        err = asyncio.run(capnp.run(main()))
    finally:
        server.close()
    assert err.code == Code.UNAVAILABLE
    assert "did not answer within 0.5s" in err.message
    assert asyncio.run(capnp.run(_refused(str(tmp_path / "none.sock")))).code == Code.UNAVAILABLE


async def _refused(path: str) -> FeosError:
    try:
        await GuestClient.connect(path)
    except FeosError as e:
        return e
    raise AssertionError("connected to nothing")


# Fuzzed requests: whatever the node sends, the agent answers and lives on ---------------------

_texts = st.text(st.characters(codec="utf-8"), max_size=40)
_requests = st.one_of(
    st.tuples(st.just("state"), _texts),
    st.tuples(st.just("start"), _texts),
    st.tuples(st.just("stop"), _texts, st.integers(0, 255), st.integers(0, 50)),
    st.tuples(st.just("delete"), _texts),
    st.tuples(st.just("logs"), _texts, st.sampled_from(["stdout", "stderr"]), st.booleans()),
    st.tuples(st.just("exec"), _texts, st.lists(_texts, max_size=3), st.lists(_texts, max_size=3)),
    st.tuples(
        st.just("create"),
        _texts,
        _texts,
        st.lists(_texts, max_size=3),
        st.lists(_texts, max_size=3),
        st.lists(st.tuples(_texts, _texts, st.booleans()), max_size=3),
        _texts,
    ),
    st.tuples(st.just("net"), _texts, _texts, st.lists(_texts, max_size=4), st.integers(0, 65535)),
    st.tuples(
        st.just("mount"),
        st.lists(
            st.tuples(_texts, st.integers(0, 255), st.integers(0, 2**40), st.booleans()), max_size=4
        ),
    ),
    st.tuples(st.just("pull"), _texts, _texts),
)


async def _send(c: GuestClient, req: tuple[Any, ...]) -> Any:
    kind, *args = req
    if kind == "state":
        return await c.container_state(args[0])
    if kind == "start":
        return await c.start_container(args[0])
    if kind == "stop":
        return await c.stop_container(args[0], args[1], args[2])
    if kind == "delete":
        return await c.delete_container(args[0])
    if kind == "logs":
        return await c.logs(args[0], args[1], follow=args[2])
    if kind == "exec":
        return await c.exec(args[0], args[1], args[2])
    if kind == "create":
        mounts = tuple(VolumeMount(n, p, r) for n, p, r in args[4])
        # The image names a registry that refuses at once: nothing leaves this machine.
        image = f"127.0.0.1:9/{args[1]}" if args[1] else ""
        return await c.create_container(
            ContainerConfig(
                args[0], image, tuple(args[2]), tuple(args[3]), mounts, working_dir=args[5]
            )
        )
    if kind == "net":
        # A MAC no device has: a valid configuration is refused before it touches a device.
        return await c.configure_network(
            NetworkConfig(args[0], args[1], tuple(args[2]), args[3], NO_DEVICE_MAC)
        )
    if kind == "mount":
        return await c.mount_volumes([VolumeSpec(n, d, s, f) for n, d, s, f in args[0]])
    return await c.pull_image(f"127.0.0.1:9/{args[0]}", args[1])


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(_requests, min_size=1, max_size=12))
def test_fuzzed_requests_never_end_the_agent(
    agent: AgentProcess, requests: list[tuple[Any, ...]]
) -> None:
    async def scenario(c: GuestClient) -> None:
        for req in requests:
            try:
                await _send(c, req)
            except FeosError as e:
                assert e.code != Code.INTERNAL, (req, e)
                assert e.code != Code.UNAVAILABLE or "registry 127.0.0.1:9" in e.message, (req, e)
        await c.ping()

    agent.run(scenario)
    assert agent.proc.poll() is None
