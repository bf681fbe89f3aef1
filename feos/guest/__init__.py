"""feos-guest, the agent inside the microVM; and the guest link's framing, which it shares.

Imports nothing: the guest's start time depends on it (feos.guest.__main__ imports the agent
inside _lean.imports()). The names below load on first use (PEP 562) and are the whole of what
the node takes of this package (feos.guestlink, the node's client): the hello and poke lines,
the Scanner and Frames that find message boundaries without I/O, and the asyncio pump that
copies a session between the link and an RPC system's socket. Nothing here imports Cap'n Proto.
"""

TYPE_CHECKING = False  # typing would cost the guest's start: mypy takes this as true
if TYPE_CHECKING:
    from ._hello import GUEST_HELLO as GUEST_HELLO
    from ._hello import NODE_POKE as NODE_POKE
    from ._hello import Frames as Frames
    from ._hello import Hello as Hello
    from ._hello import Scanner as Scanner
    from ._hello import guest_hello as guest_hello
    from ._hello import node_poke as node_poke
    from ._hello import parse_line as parse_line
    from ._link import CHUNK as CHUNK
    from ._link import Link as Link
    from ._link import Pump as Pump

_FRAMING = {
    "GUEST_HELLO": "_hello", "NODE_POKE": "_hello", "Frames": "_hello", "Hello": "_hello",
    "Scanner": "_hello", "guest_hello": "_hello", "node_poke": "_hello", "parse_line": "_hello",
    "CHUNK": "_link", "Link": "_link", "Pump": "_link",
}  # fmt: skip


def __getattr__(name: str) -> object:
    module = _FRAMING.get(name)
    if module is None:
        raise AttributeError(f"module 'feos.guest' has no attribute {name!r}")
    return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)


__all__ = sorted(_FRAMING)
