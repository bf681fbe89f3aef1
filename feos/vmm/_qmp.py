"""QMP, QEMU's JSON control protocol: the pure part (framing, replies, events) and a trio client.

Theory of operation. QMP is newline-delimited JSON over QEMU's Unix socket. QEMU greets first
({"QMP": ...}); the client must send qmp_capabilities before any other command. Each command
carries an "id" that its reply ({"return": ...} or {"error": ...}) echoes; events ({"event": ...})
arrive at any time in between. `QmpParser` turns bytes into messages and never does I/O;
`Qmp` is the thin trio loop: one reader task routes replies to their waiters by id and events to
a list of them, so a caller can wait for an event such as SHUTDOWN while it issues commands.
A file descriptor for `getfd` rides on the command's own sendmsg (SCM_RIGHTS).

Waiting for QEMU. The host's cores run the guests, so nothing here spins: `until` looks at a
state with a query, then sleeps until an event that may have changed it (MIGRATION, with the
`events` migration capability on) or a back-off pause, doubling from 1 ms, ends. The event wakes
it at once; the pause covers what QEMU announced before anyone listened (a new connection after
feosd's restart) or never announces (a chardev's connection, a socket not made yet).
"""

from __future__ import annotations

import array
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import attrs
import trio

from feos._sockpath import reachable
from feos.errors import Code, FeosError

MAX_LINE = 1 << 20  # a QMP message is small; a longer line means the peer is not QEMU
FIRST_PAUSE_S = 0.001  # the back-off's first pause; it doubles up to a caller's most
T = TypeVar("T")


@attrs.frozen
class Reply:
    id: int | None
    ok: bool
    value: Any  # "return"'s value, or the error's {"class", "desc"}


@attrs.frozen
class Event:
    name: str
    data: dict[str, Any]


@attrs.frozen
class Greeting:
    version: dict[str, Any]


Message = Reply | Event | Greeting


class QmpProtocolError(Exception):
    """The peer sent something that is not QMP."""


def decode(line: bytes) -> Message:
    """One QMP message from one line (without its newline)."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise QmpProtocolError(f"not JSON: {line[:80]!r}") from exc
    if not isinstance(obj, dict):
        raise QmpProtocolError(f"not an object: {line[:80]!r}")
    msg_id = obj.get("id")
    if msg_id is not None and not isinstance(msg_id, int):
        raise QmpProtocolError(f"an id that is not ours: {msg_id!r}")
    if "return" in obj:
        return Reply(msg_id, True, obj["return"])
    if "error" in obj:
        err = obj["error"]
        if not isinstance(err, dict):
            raise QmpProtocolError(f"a malformed error: {line[:80]!r}")
        return Reply(msg_id, False, err)
    if "event" in obj and isinstance(obj["event"], str):
        data = obj.get("data", {})
        return Event(obj["event"], data if isinstance(data, dict) else {})
    if "QMP" in obj and isinstance(obj["QMP"], dict):
        return Greeting(obj["QMP"].get("version", {}))
    raise QmpProtocolError(f"an unknown message: {line[:80]!r}")


def encode(command: str, arguments: dict[str, Any] | None, msg_id: int) -> bytes:
    msg: dict[str, Any] = {"execute": command, "id": msg_id}
    if arguments:
        msg["arguments"] = arguments
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class QmpParser:
    """Bytes in, messages out: a buffer split at newlines."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl]).strip()
            del self._buf[: nl + 1]
            if line:
                out.append(decode(line))
        if len(self._buf) > MAX_LINE:
            raise QmpProtocolError("a line over 1 MiB")
        return out


class QmpError(FeosError):
    """QEMU answered a command with an error."""

    def __init__(self, command: str, error: dict[str, Any]) -> None:
        self.qmp_class = str(error.get("class", ""))
        super().__init__(Code.INTERNAL, f"QEMU refused {command}: {error.get('desc', error)}")


class Qmp:
    """A negotiated QMP connection; made by `connect_qmp`.

    No task reads in the background: whoever waits (a command for its reply, a watcher for an
    event) reads under one lock and routes what it reads, so commands and an event watcher can
    share the connection without a nursery of its own.
    """

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        self._parser = QmpParser()
        self._next_id = 1
        self._replies: dict[int, Reply] = {}
        self._events: list[Event] = []
        self._read_lock = trio.Lock()
        self._send_lock = trio.Lock()
        self.closed = False
        self.greeting: Greeting | None = None

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, *, fd: int | None = None
    ) -> Any:
        """Run one command; its "return" value, or QmpError. Raises UNAVAILABLE once closed."""
        msg_id = self._next_id
        self._next_id += 1
        data = encode(command, arguments, msg_id)
        try:
            async with self._send_lock:
                if fd is None:
                    await _send_all(self._sock, data)
                else:
                    rights = array.array("i", [fd])
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)]
                    await self._sock.sendmsg([data], ancillary)
        except OSError as exc:
            self.closed = True
            raise FeosError(Code.UNAVAILABLE, f"QMP {command}: {exc}") from exc
        await self._pump_until(lambda: msg_id in self._replies, command)
        reply = self._replies.pop(msg_id)
        if not reply.ok:
            raise QmpError(command, reply.value)
        return reply.value

    async def wait_event(self, *names: str) -> Event:
        """The first event of these names seen since the connection opened (kept, not consumed)."""
        await self._pump_until(lambda: self.seen(*names) is not None, "/".join(names))
        event = self.seen(*names)
        assert event is not None
        return event

    def seen(self, *names: str, since: int = 0) -> Event | None:
        return next((e for e in self._events[since:] if e.name in names), None)

    def events_seen(self) -> int:
        """How many events have come so far: a mark for `wait_new_event`."""
        return len(self._events)

    async def wait_new_event(self, since: int, *names: str) -> Event:
        """The first event of these names that came after the mark `since`."""
        await self._pump_until(lambda: self.seen(*names, since=since) is not None, "/".join(names))
        event = self.seen(*names, since=since)
        assert event is not None
        return event

    async def _pump_until(self, done: Any, what: str) -> None:
        while not done():
            if self.closed:
                raise FeosError(Code.UNAVAILABLE, f"QEMU closed QMP before {what}")
            async with self._read_lock:
                if done() or self.closed:
                    continue
                try:
                    data = await self._sock.recv(65536)
                    messages = self._parser.feed(data) if data else []
                except (OSError, QmpProtocolError):
                    data = b""
                if not data:
                    self.closed = True
                for msg in messages if data else []:
                    self._route(msg)

    def _route(self, msg: Message) -> None:
        if isinstance(msg, Event):
            self._events.append(msg)
        elif isinstance(msg, Reply) and msg.id is not None:
            self._replies[msg.id] = msg
        elif isinstance(msg, Greeting):
            self.greeting = msg

    def close(self) -> None:
        self.closed = True
        self._sock.close()


def backoff(most: float) -> Iterator[float]:
    """Pauses between looks: from FIRST_PAUSE_S, doubling, never over `most`."""
    pause = FIRST_PAUSE_S
    while True:
        yield pause
        pause = min(2 * pause, most)


async def until(qmp: Qmp, probe: Callable[[], Awaitable[T | None]], *events: str,
                most: float) -> T:  # fmt: skip
    """probe()'s first answer that is not None; between looks, until one of `events` comes
    (after the mark taken before the look, so none is missed) or the back-off's pause ends."""
    for pause in backoff(most):
        mark = qmp.events_seen()
        answer = await probe()
        if answer is not None:
            return answer
        with trio.move_on_after(pause):
            if events:
                await qmp.wait_new_event(mark, *events)
            else:
                await trio.sleep_forever()
    raise AssertionError("backoff() never ends")


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def connect_qmp(path: str, *, within: float = 5.0) -> Qmp:
    """Connect to QEMU's QMP socket and negotiate, within `within`; close() it when done."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    qmp = Qmp(sock)
    try:
        with trio.fail_after(within), reachable(path) as short:
            await sock.connect(short)
            await qmp.execute("qmp_capabilities")
    except trio.TooSlowError:
        qmp.close()
        raise FeosError(Code.UNAVAILABLE, f"QMP {path} did not answer within {within}s") from None
    except OSError as exc:
        qmp.close()
        raise FeosError(Code.UNAVAILABLE, f"QMP {path}: {exc}") from exc
    except BaseException:
        qmp.close()
        raise
    return qmp
