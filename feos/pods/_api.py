"""PodService's parameters as attrs values, structured and checked once at the API's edge.

The RPC server hands every call's params over as the dict of its Cap'n Proto struct (camelCase
keys, fields at their defaults left out). `@edge(Request)` structures that dict into `Request`
through feos._codec's converter, whose fields check themselves (a pod ID, a spec: parse_spec),
so a handler takes a typed value and never looks into a dict; a bad value answers
INVALID_ARGUMENT naming its field. A handler may also be called with the value itself (tests,
the node's own calls).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs

from .._codec import converter, structure_params
from ..errors import invalid
from ._spec import PodSpec, check_pod_id, parse_spec

S = TypeVar("S")
R = TypeVar("R")
A = TypeVar("A")

_pods = converter.copy()
_pods.register_structure_hook(PodSpec, lambda data, _: parse_spec(data))


def _default_spec() -> PodSpec:
    return parse_spec({})


def _command(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise invalid("command", "must name a program")
    return value


def _watched(value: str) -> str:
    return check_pod_id(value, "podId") if value else ""


@attrs.frozen
class PodRef:
    """GetPod, StopPod, DeletePod, SuspendPod, ResumePod: the pod's ID."""

    id: str = attrs.field(default="", converter=check_pod_id)


@attrs.frozen
class CreatePod:
    id: str = attrs.field(default="", converter=check_pod_id)
    spec: PodSpec = attrs.field(factory=_default_spec)
    pull_token: str = attrs.field(default="", repr=False)
    image_layers: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class StartPod:
    id: str = attrs.field(default="", converter=check_pod_id)
    pull_token: str = attrs.field(default="", repr=False)


@attrs.frozen
class HibernatePod:
    id: str = attrs.field(default="", converter=check_pod_id)
    no_abandon: bool = False


def _checkpoint_ref(value: str) -> str:
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", value):
        raise invalid("checkpoint", f"{value!r} is not sha256:<64 lowercase hex digits>")
    return value


@attrs.frozen
class RestorePod:
    id: str = attrs.field(default="", converter=check_pod_id)
    spec: PodSpec | None = None  # None: the checkpoint's own
    checkpoint: str = attrs.field(default="", converter=_checkpoint_ref)


@attrs.frozen
class ListPods:
    pass


@attrs.frozen
class KeyValue:
    key: str = ""
    value: str = ""


@attrs.frozen
class ExecInPod:
    id: str = attrs.field(default="", converter=check_pod_id)
    container: str = ""
    command: tuple[str, ...] = attrs.field(default=(), converter=_command)
    env: tuple[KeyValue, ...] = ()
    tty: bool = False
    working_dir: str = ""
    rows: int = 0
    cols: int = 0

    def environment(self) -> list[str]:
        return [f"{kv.key}={kv.value}" for kv in self.env]


@attrs.frozen
class PodLogs:
    id: str = attrs.field(default="", converter=check_pod_id)
    container: str = ""
    follow: bool = False


@attrs.frozen
class WatchEvents:
    pod_id: str = attrs.field(default="", converter=_watched)  # "": every pod's


def edge(request: type[A]) -> Callable[[Callable[[S, A], Awaitable[R]]],
                                       Callable[[S, A | dict[str, Any]], Awaitable[R]]]:
    """A handler of typed params, served to the RPC server's dicts."""

    def wrap(fn: Callable[[S, A], Awaitable[R]]) -> Callable[[S, A | dict[str, Any]],
                                                              Awaitable[R]]:
        @functools.wraps(fn)
        async def handler(self: S, params: A | dict[str, Any]) -> R:
            if isinstance(params, dict):
                params = structure_params(params, request, _pods)
            return await fn(self, params)

        return handler

    return wrap
