"""The guest link's framing, without I/O: hello lines, pokes, and Cap'n Proto message boundaries.

Theory of operation. The link is one byte stream that outlives sessions (a virtio-serial port
survives agent restarts and VM suspends). A session starts with the agent's hello line,
`FEOS-GUEST 1 <boot-id> <session>\n`, after which both ends speak Cap'n Proto's stream framing.
Either end may start a new session at a message boundary: the agent by sending a new hello, the
node by sending a poke line, `FEOS-NODE 1 <nonce>\n`, to which the agent answers with a new hello.
A line can be told from a message at a boundary because a message starts with its segment count
less one (a little-endian u32, below 512), and "FEOS" read so is over a billion.

`Scanner` follows the boundaries of one direction and splits what it is fed into message bytes
and lines, so each end's pump can pass messages to its RPC system and act on the lines.
"""

from __future__ import annotations

import struct

GUEST_HELLO = b"FEOS-GUEST"
NODE_POKE = b"FEOS-NODE"
LINK_VERSION = 1
MAX_LINE = 512
MAX_SEGMENTS = 512  # KJ refuses more; past it the bytes are passed on and the RPC system fails

_MAGIC = b"FEOS"


class Hello:
    """A parsed hello (the agent's) or poke (the node's) line."""

    __slots__ = ("fields", "kind")

    def __init__(self, kind: bytes, fields: tuple[str, ...]) -> None:
        self.kind = kind
        self.fields = fields

    def __repr__(self) -> str:
        return f"Hello({self.kind!r}, {self.fields!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hello) and (self.kind, self.fields) == (other.kind, other.fields)

    def __hash__(self) -> int:
        return hash((self.kind, self.fields))


def guest_hello(boot_id: str, session: str) -> bytes:
    return f"FEOS-GUEST {LINK_VERSION} {boot_id} {session}\n".encode()


def node_poke(nonce: str) -> bytes:
    return f"FEOS-NODE {LINK_VERSION} {nonce}\n".encode()


def parse_line(line: bytes) -> Hello | None:
    """A hello or poke line (with or without its newline), or None if it is neither."""
    words = line.rstrip(b"\n").split(b" ")
    if len(words) < 2 or words[0] not in (GUEST_HELLO, NODE_POKE):
        return None
    if words[1] != str(LINK_VERSION).encode() or not all(words[2:]):
        return None
    try:
        fields = tuple(w.decode("ascii") for w in words[2:])
    except UnicodeDecodeError:
        return None
    if words[0] == GUEST_HELLO and len(fields) != 2:
        return None
    return Hello(words[0], fields)


class Scanner:
    """Splits one direction of the link into ("data", bytes) and ("line", Hello | None) events.

    A line is recognised only at a message boundary; a line that is not a hello or poke, or
    that is too long, is reported as ("line", None) and dropped.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._left = 0  # bytes of the current message still to pass on
        self._passthrough = False  # framing lost: pass everything on

    def feed(self, data: bytes) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._buf += data
        while self._buf:
            if self._passthrough or self._left:
                n = len(self._buf) if self._passthrough else min(self._left, len(self._buf))
                self._emit(out, bytes(self._buf[:n]))
                del self._buf[:n]
                if not self._passthrough:
                    self._left -= n
                continue
            if not self._boundary(out):
                break
        return out

    def _boundary(self, out: list[tuple[str, object]]) -> bool:
        """At a message boundary: take a line or a message header; False if more is needed."""
        if len(self._buf) < 4:
            return False
        if self._buf[:4] == _MAGIC:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_LINE:
                    out.append(("line", None))
                    self._passthrough = True
                return False
            line = bytes(self._buf[: end + 1])
            del self._buf[: end + 1]
            out.append(("line", parse_line(line) if len(line) <= MAX_LINE else None))
            return True
        (count_less_one,) = struct.unpack_from("<I", self._buf)
        count = count_less_one + 1
        if count > MAX_SEGMENTS:
            self._passthrough = True
            return True
        header = 4 * (count + 1)
        header += header % 8
        if len(self._buf) < header:
            return False
        sizes = struct.unpack_from(f"<{count}I", self._buf, 4)
        self._left = header + 8 * sum(sizes)
        return True

    @staticmethod
    def _emit(out: list[tuple[str, object]], data: bytes) -> None:
        if out and out[-1][0] == "data":
            out[-1] = ("data", out[-1][1] + data)  # type: ignore[operator]
        else:
            out.append(("data", data))


class Frames:
    """Cuts one direction of the link after its last whole message or line, without I/O.

    The node sends only what `feed` gives back, so the bytes on the link always end at a
    boundary: a link held there (before a suspend) can go on later over another connection, or
    take a poke, without the guest's Scanner finding a message cut in two. Framing it cannot
    follow (more than MAX_SEGMENTS segments, an overlong line) is passed on as it comes, as the
    Scanner passes it on.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # bytes of _buf looked at; _buf[:_whole] ends at a boundary
        self._whole = 0
        self._left = 0  # bytes still to come of the message at _pos
        self._passthrough = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        if self._passthrough:
            self._whole = len(self._buf)
        while not self._passthrough and self._step():
            pass
        out = bytes(self._buf[: self._whole])
        del self._buf[: self._whole]
        self._pos -= self._whole
        self._whole = 0
        return out

    @property
    def pending(self) -> int:
        """Bytes held back: the part of a message or line fed so far."""
        return len(self._buf)

    def _step(self) -> bool:
        """Moves past one more message part or boundary item; False when more is needed."""
        if self._left:
            n = min(self._left, len(self._buf) - self._pos)
            self._pos += n
            self._left -= n
            if self._left:
                return False
            self._whole = self._pos
            return True
        rest = len(self._buf) - self._pos
        if rest < 4:
            return False
        if self._buf[self._pos : self._pos + 4] == _MAGIC:
            end = self._buf.find(b"\n", self._pos)
            if end < 0:
                if rest > MAX_LINE:
                    self._lose()
                return False
            self._pos = self._whole = end + 1
            return True
        (count_less_one,) = struct.unpack_from("<I", self._buf, self._pos)
        count = count_less_one + 1
        if count > MAX_SEGMENTS:
            self._lose()
            return False
        header = 4 * (count + 1)
        header += header % 8
        if rest < header:
            return False
        sizes = struct.unpack_from(f"<{count}I", self._buf, self._pos + 4)
        self._left = header + 8 * sum(sizes)
        return True

    def _lose(self) -> None:
        self._passthrough = True
        self._whole = len(self._buf)
