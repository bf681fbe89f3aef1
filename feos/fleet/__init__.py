"""feos.fleet: the control-plane link (docs/control-plane.md).

The join and the node's identity, the uplink (reports, events, renewals, JoinMesh), the check of
the control plane's chain, and the node connections, on a thread of the link's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ._calls import Dispatcher as Dispatcher
from ._events import EventBuffer as EventBuffer
from ._h2client import split_address
from ._link import Link as Link
from ._link import Runtime as Runtime
from ._nodeconn import NodeConnections as NodeConnections
from ._nodeconn import Target as Target
from ._nodeconn import stop_message as stop_message
from ._uplink import LinkConfig as LinkConfig
from ._verify import Refused as Refused
from ._verify import Verifier as Verifier
from ._verify import client_context as client_context


def make_link(cfg: LinkConfig, runtime: Runtime, services: Mapping[str, object],
              main_token: trio.lowlevel.TrioToken, *, bridge: Any = None) -> Link:
    """The link, with node connections serving `services` (keyed as the API's bootstrap).

    `bridge` is feosd's Cap'n Proto thread: the streams' relays (logs, the console, exec) run
    there, as they do for a call on the socket."""
    connections = NodeConnections(Dispatcher(services, main_token, bridge=bridge))

    def target(address: str, name: str) -> Target:
        host, port = split_address(address)
        return Target(host, port, name)

    return Link(cfg, runtime, connections, target)
