"""The console's one way into feosd: the API's own handlers, called as the RPC server calls them.

Theory of operation: the RPC server (feos.rpc._server) turns a call of `Service.methodName` into
`await impl.method_name(params)` with the params as a dict and writes back the dict it returns;
a FeosError becomes the answer's status. `Api` does exactly that for the console, over the same
service objects feosd's bootstrap hands the RPC server, so the console can never disagree with
the API. A stream in an answer (`Cap`) is read as a client would read it: `next` or `read` called
until the end, on the Cap'n Proto thread when the stream lives there (`on_rpc_thread`). If the
services' signatures change, this module alone changes.
"""

from __future__ import annotations

import base64
import inspect
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs

from .._codec import snake
from ..errors import Code, FeosError
from ..rpc import Cap, CapnpThread, status_dict

# What the console may call: (service, method) -> whether the call changes anything.
CALLS: dict[tuple[str, str], bool] = {
    ("pods", "listPods"): False,
    ("pods", "getPod"): False,
    ("pods", "createPod"): True,
    ("pods", "startPod"): True,
    ("pods", "stopPod"): True,
    ("pods", "suspendPod"): True,
    ("pods", "resumePod"): True,
    ("pods", "deletePod"): True,
    ("volumes", "listVolumes"): False,
    ("volumes", "createVolume"): True,
    ("volumes", "deleteVolume"): True,
    ("securityGroups", "listSecurityGroups"): False,
    ("securityGroups", "putSecurityGroup"): True,
    ("securityGroups", "deleteSecurityGroup"): True,
    ("names", "listNameTables"): False,
    ("names", "putNameTable"): True,
    ("names", "deleteNameTable"): True,
    ("mesh", "getMesh"): False,
}

# The streams the console follows: name -> (service, method).
STREAMS: dict[str, tuple[str, str]] = {
    "logs": ("pods", "podLogs"),
    "console": ("pods", "consoleLog"),
}


def error_answer(exc: FeosError) -> dict[str, Any]:
    """A failed call's answer, as the API's status: {"status": {"code", "message"}}."""
    return {"status": status_dict(exc)}


@attrs.define
class Api:
    """The services by the bootstrap's names ("pods", "volumes", "securityGroups", "names")."""

    services: Mapping[str, object]
    bridge: CapnpThread | None = None
    vms: object = None  # for consoleLog while PodService has no method of its own

    def _handler(self, service: str, method: str) -> Any:
        impl = self.services.get(service)
        target = getattr(impl, snake(method), None) if impl is not None else None
        if target is None and (service, method) == ("pods", "consoleLog"):
            from ..pods import console_log

            return lambda params: console_log(impl, self.vms, params)
        if target is None:
            raise FeosError(Code.UNIMPLEMENTED, f"{method} is not built yet")
        return target

    async def call(self, service: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """One unary call of the console's table; FeosError as the API raises it."""
        if (service, method) not in CALLS:
            raise FeosError(Code.NOT_FOUND, f"{service}.{method}: not a call of the console")
        answer = await _called(self._handler(service, method), params, self.bridge)
        return _keys_as_base64(answer) if service == "mesh" else answer

    async def events(self, pod_id: str = "") -> AsyncIterator[list[dict[str, Any]]]:
        """WatchEvents' stream, batch by batch, until feosd stops or the caller leaves."""
        stream = _impl(await _called(self._handler("pods", "watchEvents"), {"podId": pod_id},
                                     self.bridge))
        try:
            while True:
                batch = await self._pull(stream.next, {"max": 256})
                if batch.get("events"):
                    yield list(batch["events"])
                if batch.get("end"):
                    return
        finally:
            _let_go(stream)

    async def bytes(self, name: str, params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A ByteStream (a container's logs, the serial console) read to its end."""
        service, method = STREAMS[name]
        stream = _impl(await _called(self._handler(service, method), params, self.bridge))
        try:
            while True:
                chunk = await self._pull(stream.read, {})
                yield chunk
                if chunk.get("exited"):
                    return
        finally:
            _let_go(stream)

    async def _pull(self, fn: Any, params: dict[str, Any]) -> dict[str, Any]:
        if getattr(fn, "_feos_rpc_thread", False):
            if self.bridge is None:
                raise FeosError(Code.UNAVAILABLE, "no Cap'n Proto thread")
            result: dict[str, Any] = await self.bridge.call(fn, params)
            return result
        pulled: dict[str, Any] = await fn(params)
        return pulled


async def _called(target: Any, params: dict[str, Any],
                  bridge: CapnpThread | None = None) -> dict[str, Any]:
    """As the RPC server calls a handler: one marked `on_rpc_thread` on the Cap'n Proto thread
    (where its answers, Cap'n Proto readers, are read back as dicts), any other in trio."""
    if getattr(target, "_feos_rpc_thread", False) and bridge is not None:
        return dict(await bridge.call(_on_rpc_thread, target, params))
    return dict(plain(await _maybe_await(target(params))))


async def _on_rpc_thread(target: Any, params: dict[str, Any]) -> dict[str, Any]:
    return dict(plain(await _maybe_await(target(params))))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _keys_as_base64(answer: dict[str, Any]) -> dict[str, Any]:
    """The mesh's WireGuard keys as wg(8) writes them (JSON has no bytes)."""
    mesh = dict(plain(answer).get("mesh", {}))
    mesh["publicKey"] = base64.b64encode(bytes(mesh.get("publicKey", b""))).decode()
    mesh["peers"] = [{**p, "publicKey": base64.b64encode(bytes(p.get("publicKey", b""))).decode()}
                     for p in mesh.get("peers", [])]
    return {**answer, "mesh": mesh}


def plain(value: Any) -> Any:
    """An answer with every Cap'n Proto reader in it as its dict (a Cap is kept as it is)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "to_dict") and not isinstance(value, Cap):
        return value.to_dict()
    return value


def _impl(answer: dict[str, Any]) -> Any:
    cap = answer.get("stream")
    if not isinstance(cap, Cap):
        raise FeosError(Code.INTERNAL, "the answer holds no stream")
    return cap.impl


def _let_go(stream: Any) -> None:
    """What a client's release does: the relay's `released`, the watcher's `close`."""
    for name in ("released", "close"):
        end = getattr(stream, name, None)
        if callable(end):
            end()
            return
