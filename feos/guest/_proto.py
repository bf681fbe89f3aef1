"""The guest's side of schema/guest.capnp on its own Cap'n Proto (_wire, _rpc): `guest`, whose
interfaces' Server classes the agent implements, and the agent's Status <-> FeosError
conversions. The node has its own of both (feos._schema's pycapnp load, feos.rpc's
raise_for_status): it imports nothing of this module.
"""

from __future__ import annotations

from feos.errors import Code, FeosError

from ._rpc import Schema

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

guest: Any = Schema("guest.capnp")


def code_name(code: Code) -> str:
    """INVALID_ARGUMENT -> invalidArgument, as schema/common.capnp names the enum's values."""
    first, *rest = code.name.lower().split("_")
    return first + "".join(w.capitalize() for w in rest)


_BY_NAME = {code_name(c): c for c in Code}


def fill_status(status: Any, error: FeosError) -> None:
    status.code = code_name(error.code)
    status.message = error.message
    if error.busy:
        status.init("vmBusy")


def raise_status(status: Any) -> None:
    """Raises the FeosError a non-ok Status stands for."""
    name = str(status.code)
    if name == "ok":
        return
    code = _BY_NAME.get(name, Code.UNKNOWN)
    raise FeosError(code, str(status.message), busy=bool(status._has("vmBusy")))
