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

T = TypeVar("T")



def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False, omit_if_default=False)

    def structure_factory(cls: type) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_structure_fn(cls, conv, **renames)  # type: ignore[arg-type]

    def unstructure_factory(cls: type) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_unstructure_fn(cls, conv, **renames)  # type: ignore[arg-type]

    conv.register_structure_hook_factory(attrs.has, structure_factory)
    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    return conv


converter = _converter()


def structure(data: dict[str, Any], cls: type[T]) -> T:
    return converter.structure(data, cls)


def unstructure(value: Any) -> Any:
    return converter.unstructure(value)
