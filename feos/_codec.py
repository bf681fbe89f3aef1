"""Conversions at the API's edge: Cap'n Proto's dicts (camelCase) to attrs values and back.

Cap'n Proto readers never leave the RPC thread: the server turns params into plain dicts there
(`to_dict()`), and a service's method structures them into its attrs params class on entry,
through `takes(cls)`: the names are the schema's in camelCase, the scalars are checked for their
kind (no coercion: 5 is not "5"), the classes' own validators check the rules, and any failure is
INVALID_ARGUMENT naming the field (`labels[2].key: ...`). The method itself then takes typed values.
Answers are unstructured into dicts the server writes into the results.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ._names import camel as camel
from ._names import snake as snake
from .errors import FeosError, invalid

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")

_KINDS: dict[type, str] = {
    str: "a string", int: "an integer", bool: "true or false", bytes: "bytes"
}


@attrs.frozen
class NoParams:
    """The params of a call that takes none (what is sent is ignored)."""


def _strict(kind: type) -> Callable[[Any, type], Any]:
    def structure(value: Any, _cls: type) -> Any:
        if type(value) is not kind:
            raise TypeError(f"must be {_KINDS[kind]}")
        return value

    return structure

def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False, omit_if_default=False)

    # Factories of two arguments are handed the converter that asks: a copy with hooks of its
    # own (feos.pods' PodSpec) structures the fields with those.
    def structure_factory(cls: type, conv: cattrs.Converter) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_structure_fn(cls, conv, **renames)  # type: ignore[arg-type]

    def unstructure_factory(cls: type, conv: cattrs.Converter) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_unstructure_fn(cls, conv, **renames)  # type: ignore[arg-type]

    conv.register_structure_hook_factory(attrs.has, structure_factory)
    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    for kind in _KINDS:
        conv.register_structure_hook(kind, _strict(kind))
    return conv


converter = _converter()


def structure(data: dict[str, Any], cls: type[T]) -> T:
    return converter.structure(data, cls)


def unstructure(value: Any) -> Any:
    return converter.unstructure(value)


def structure_params(data: dict[str, Any], cls: type[T], conv: cattrs.Converter = converter) -> T:
    """A call's params as cls, checked; INVALID_ARGUMENT naming the field if they are not (the
    FeosError a field's own check raised, or what cattrs found wrong). `conv` may be a copy of
    `converter` with hooks of its own (feos.pods' PodSpec)."""
    try:
        return conv.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        raise _invalid(exc) from None


def takes(cls: type[T]) -> Callable[[Callable[[S, T], R]], Callable[[S, dict[str, Any]], R]]:
    """A service method taking `cls`, called with the params' dict (as the RPC server calls)."""

    def decorate(method: Callable[[S, T], R]) -> Callable[[S, dict[str, Any]], R]:
        if inspect.iscoroutinefunction(method):  # stays one, for those that ask (fleet's calls)

            @functools.wraps(method)
            async def entry_async(self: S, params: dict[str, Any]) -> Any:
                return await method(self, structure_params(params, cls))

            return cast(Callable[[S, dict[str, Any]], R], entry_async)

        @functools.wraps(method)
        def entry(self: S, params: dict[str, Any]) -> R:
            return method(self, structure_params(params, cls))

        return entry

    return decorate


def _own_error(exc: BaseException) -> FeosError | None:
    """A FeosError a validator raised, wherever cattrs grouped it."""
    if isinstance(exc, FeosError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _own_error(inner)
        if found is not None:
            return found
    return None


def _invalid(exc: cattrs.BaseValidationError) -> FeosError:
    own = _own_error(exc)
    if own is not None:  # anew, without the notes cattrs added on its way out
        return FeosError(own.code, own.message, busy=own.busy)
    rule, _, where = cattrs.transform_error(exc, path="")[0].rpartition(" @ ")
    field = re.sub(r"[a-z0-9_]+", lambda m: camel(m.group()), where).lstrip(".")
    return invalid(field or "params", rule)
