"""Conversions at the API's edge: Cap'n Proto's dicts (camelCase) to attrs values and back.

Cap'n Proto readers never leave the RPC thread: the server turns params into plain dicts there
(`to_dict()`), the services structure those into attrs values here, and unstructure their answers
into dicts that the server writes into the results.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ._names import camel as camel
from ._names import snake as snake
from .errors import Code, FeosError

T = TypeVar("T")


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
    return conv


converter = _converter()


def structure(data: dict[str, Any], cls: type[T]) -> T:
    return converter.structure(data, cls)


def structure_params(data: dict[str, Any], cls: type[T], conv: cattrs.Converter = converter) -> T:
    """A call's params as `cls`, checked once here: the FeosError a field's check raised
    (INVALID_ARGUMENT naming the field), or INVALID_ARGUMENT with cattrs' account of what is
    wrong for a value of the wrong type."""
    try:
        return conv.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        found = _feos_error(exc)
        if found is not None:
            raise found from None
        why = "; ".join(cattrs.transform_error(exc))
        raise FeosError(Code.INVALID_ARGUMENT, why) from None


def _feos_error(exc: BaseException) -> FeosError | None:
    if isinstance(exc, FeosError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _feos_error(inner)
        if found is not None:
            return found
    return None


def unstructure(value: Any) -> Any:
    return converter.unstructure(value)
