"""QMP's pure part: framing, replies, events, greeting, and what is not QMP."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from feos.vmm._qemu import MIGRATION_PAUSE_S
from feos.vmm._qmp import (
    Event,
    Greeting,
    Qmp,
    QmpParser,
    QmpProtocolError,
    Reply,
    decode,
    encode,
)


def test_greeting_reply_error_event() -> None:
    parser = QmpParser()
    msgs = parser.feed(
        b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n'
        b'{"return": {}, "id": 1}\r\n'
        b'{"error": {"class": "GenericError", "desc": "no"}, "id": 2}\r\n'
        b'{"timestamp": {"seconds": 1}, "event": "SHUTDOWN", "data": {"guest": true}}\r\n'
    )
    assert msgs == [
        Greeting({"qemu": {"major": 7}}),
        Reply(1, True, {}),
        Reply(2, False, {"class": "GenericError", "desc": "no"}),
        Event("SHUTDOWN", {"guest": True}),
    ]


def test_split_across_reads() -> None:
    parser = QmpParser()
    line = b'{"return": {"status": "running"}, "id": 7}\n'
    assert parser.feed(line[:10]) == []
    assert parser.feed(line[10:]) == [Reply(7, True, {"status": "running"})]


def test_encode_carries_id_and_arguments() -> None:
    assert json.loads(encode("migrate", {"uri": "fd:snapshot"}, 3)) == {
        "execute": "migrate", "id": 3, "arguments": {"uri": "fd:snapshot"}}  # fmt: skip
    assert json.loads(encode("stop", None, 4)) == {"execute": "stop", "id": 4}
    assert encode("stop", None, 4).endswith(b"\n")


@pytest.mark.parametrize(
    "line", [b"[1]", b"not json", b'{"what": 1}', b'{"return": 1, "id": "x"}', b'{"error": 3}']
)
def test_not_qmp(line: bytes) -> None:
    with pytest.raises(QmpProtocolError):
        decode(line)


def test_a_line_too_long() -> None:
    with pytest.raises(QmpProtocolError):
        QmpParser().feed(b"x" * (2 << 20))


@given(st.binary(max_size=300))
def test_parser_takes_any_bytes(data: bytes) -> None:
    parser = QmpParser()
    try:
        for msg in parser.feed(data):
            assert isinstance(msg, Reply | Event | Greeting)
    except QmpProtocolError:
        pass


@given(st.dictionaries(st.text(max_size=5), st.integers(), max_size=4), st.integers(1, 1 << 40))
def test_replies_round_trip(value: dict[str, int], msg_id: int) -> None:
    line = json.dumps({"return": value, "id": msg_id}).encode()
    assert decode(line) == Reply(msg_id, True, value)


# -- waiting for QEMU: events wake the wait, a back-off covers the rest -----------------------


class FakeQemu:
    """QEMU's side of a socketpair: answers query-migrate, and ends the migration at `ends`."""

    def __init__(self, sock: trio.socket.SocketType, ends: float, announce: bool) -> None:
        self.sock, self.ends, self.announce = sock, ends, announce
        self.queries = 0

    async def run(self) -> None:
        buf = b""
        while data := await self.sock.recv(65536):
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                await self._answer(json.loads(line))

    async def _answer(self, msg: dict[str, Any]) -> None:
        self.queries += msg["execute"] == "query-migrate"
        done = trio.current_time() >= self.ends
        reply = {"return": {"status": "completed" if done else "active"}, "id": msg["id"]}
        await self.sock.send(json.dumps(reply).encode() + b"\n")

    async def end_migration(self) -> None:
        await trio.sleep_until(self.ends)
        if self.announce:
            event = {"event": "MIGRATION", "data": {"status": "completed"}}
            await self.sock.send(json.dumps(event).encode() + b"\n")


async def _migrate(announce: bool) -> tuple[float, int]:
    from feos.vmm._qemu import _migrated

    ours, theirs = trio.socket.socketpair()
    qemu = FakeQemu(theirs, trio.current_time() + 1.0, announce)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(qemu.run)
        nursery.start_soon(qemu.end_migration)
        assert await _migrated(Qmp(ours)) == "completed"
        nursery.cancel_scope.cancel()
    ours.close()
    theirs.close()
    return trio.current_time() - qemu.ends, qemu.queries


async def test_a_migration_s_end_is_woken_by_its_event(autojump_clock: Any) -> None:
    late, queries = await _migrate(announce=True)
    assert late == 0  # the event's own instant, not the next pause's
    assert queries <= 30  # a second of migration: the back-off, not a 2 ms poll (500)


async def test_without_its_event_the_wait_backs_off(autojump_clock: Any) -> None:
    late, queries = await _migrate(announce=False)
    assert 0 <= late <= MIGRATION_PAUSE_S
    assert queries <= 30
