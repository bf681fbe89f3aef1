"""feos.fleet: the control-plane link (docs/control-plane.md).

The join and the node's identity, the uplink (reports, events, renewals, JoinMesh), the check of
the control plane's chain, and the node connections, on a thread of the link's own.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio

from ._events import EventBuffer as EventBuffer
from ._h2client import split_address
from ._link import Link as Link
from ._link import Runtime as Runtime
from ._uplink import LinkConfig as LinkConfig
from ._verify import Refused as Refused
from ._verify import Verifier as Verifier
from ._verify import client_context as client_context

log = logging.getLogger(__name__)


def make_link(cfg: LinkConfig, runtime: Runtime, services: Mapping[str, object],
              main_token: trio.lowlevel.TrioToken) -> Link:
    """The link, with node connections serving `services` (keyed as the API's bootstrap)."""
    connections, target = _node_connections(services, main_token)
    return Link(cfg, runtime, connections, target)


def _node_connections(services: Mapping[str, object], main_token: trio.lowlevel.TrioToken
                      ) -> tuple[Any, Callable[[str, str], Any]]:
    try:
        nodeconn = importlib.import_module("feos.fleet._nodeconn")
        calls = importlib.import_module("feos.fleet._calls")
    except ImportError:
        log.warning("this build of feosd has no node connections (feos.fleet._nodeconn): "
                    "the uplink runs without them")
        return None, lambda address, name: (address, name)

    def target(address: str, name: str) -> Any:
        host, port = split_address(address)
        return nodeconn.Target(host, port, name)

    return nodeconn.NodeConnections(calls.Dispatcher(services, main_token)), target
