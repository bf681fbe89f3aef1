"""The guest link's sessions against a scripted guest: the pushes after an attach, the hold
while a snapshot loads, and the one ping of a resumed guest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.testing

from feos.vmm._guestlink import GuestLink


class Bridge:
    """The RPC bridge's call, run in place (these clients live on trio)."""

    async def call(self, fn: Any, *args: Any) -> Any:
        return await fn(*args)


def stub_waits(monkeypatch: Any) -> None:
    """GuestLink's waits on a client made the fakes' own: an attach logged at once, an end when
    the fake's `ended` is set (test_vmm_linkpark uses these too)."""
    import feos.vmm._guestlink as gl

    async def attached(client: Any, within: float) -> None:
        client.log.append("attached")

    async def ended(client: Any) -> None:
        await client.ended.wait()

    monkeypatch.setattr(gl, "_wait_attached", attached)
    monkeypatch.setattr(gl, "_wait_ended", ended)


class _Client:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.boot_id = "boot"
        self.ended = trio.Event()

    async def ping(self) -> None:
        self.log.append("ping")

    async def set_time(self, ns: int) -> None:
        self.log.append("set_time")

    async def configure_network(self, config: Any) -> None:
        self.log.append(f"network {config}")

    async def close(self) -> None:
        self.ended.set()


async def test_attach_pushes_and_a_resume_pings_first(
    autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    stub_waits(monkeypatch)
    log: list[str] = []
    clients: list[_Client] = []
    dials: list[float] = []

    async def connect(path: str) -> _Client:
        dials.append(trio.current_time())
        clients.append(_Client(log))
        return clients[-1]

    async def network() -> str:
        return "cfg"

    seen: list[str] = []
    link = GuestLink("abcdefghjkm", Path("/nonexistent"), Bridge(), network=network,
                     on_attach=lambda c: seen.append(c.boot_id), connect=connect)  # fmt: skip
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        await link.wait_attach(0)
        assert log == ["attached", "set_time", "network cfg"]
        assert seen == ["boot"]
        pinged = link.resuming()
        clients[-1].ended.set()  # the VMM ended (a suspend)
        await trio.sleep(30)
        assert len(dials) == 1  # held while the snapshot loads
        log.clear()
        link.kick()
        with trio.fail_after(1):
            await pinged.wait()
        await link.wait_attach(1)
        assert log == ["ping", "set_time", "network cfg"]
        assert len(dials) == 2
        nursery.cancel_scope.cancel()
