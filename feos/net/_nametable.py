"""Name tables: the names a pod's resolver answers itself, with authority.

The model, precisely (the schema and the NameService store follow it):

* A NameTable has
  - ``id``: one DNS label in lower case, 1 to 63 characters of ``a-z``, ``0-9`` and ``-``, neither
    first nor last a ``-``. A lowercase UUID (``8-4-4-4-12`` hex digits) is such a label, so both a
    short ID and a UUID are taken; an uppercase one is refused, not folded.
  - ``version``: an integer from 0 to 2**64 - 1, the control plane's, which need not grow.
  - ``names``: a mapping of at most 100,000 names to their addresses. A name is one DNS label in
    lower case (the rule of ``id``); it has 1 to 64 addresses, each an IPv6 or an IPv4 address,
    without a zone, kept in the order given with duplicates removed. AAAA answers carry the IPv6
    ones, A answers the IPv4 ones.
  - ``includes``: at most 64 table IDs (each valid as ``id``), no duplicates, not the table itself.
* A NameTableDelta (UpdateNameTable) names a table, ``from_version`` and ``to_version``, the names
  it puts (a mapping as ``names``: a put name's addresses replace the old ones) and the names it
  removes (a name it does not hold is no error). A name may not be both put and removed. It
  applies only to the version the node has: from any other it fails with FAILED_PRECONDITION,
  naming both versions. A delta does not change ``includes``: a whole put does.
* Lookup for a pod goes through the pod's tables in order, and the first that holds the name
  answers it, even when it holds no address of the family asked. Within a table, its own names come
  before those of the tables it includes, in their order; the includes of an included table are not
  followed; a table the node does not have holds nothing. A queried name matches when it is one
  label and equal to a held name ignoring ASCII case.

Errors are feos.errors.invalid(field, rule) with fields ``id``, ``version``, ``names[<name>]``,
``names[<name>].addresses[<i>]``, ``includes[<i>]`` and, for a delta, ``put[...]``/``removed[<i>]``.
"""

from __future__ import annotations

import ipaddress
import re
import types
from collections.abc import Iterable, Mapping, Sequence

import attrs

from feos.errors import Code, FeosError, invalid

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_NAMES = 100_000
MAX_ADDRESSES = 64
MAX_INCLUDES = 64
MAX_VERSION = 2**64 - 1

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_LABEL_RULE = (
    "must be one DNS label in lower case: 1 to 63 of a-z, 0-9 and -, not starting or ending with -"
)


def is_label(text: str) -> bool:
    """Whether text is one DNS label in lower case (the rule of table IDs and names)."""
    return _LABEL.fullmatch(text) is not None


def _address(field: str, value: object) -> Address:
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        parsed: Address = value
    elif isinstance(value, str):
        try:
            parsed = ipaddress.ip_address(value)
        except ValueError:
            raise invalid(field, f"{value!r} is not an IPv6 or IPv4 address") from None
    else:
        raise invalid(field, "must be an IPv6 or IPv4 address")
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.scope_id is not None:
        raise invalid(field, "must not have a zone")
    return parsed


def _names(field: str, names: Mapping[str, Iterable[object]]) -> Mapping[str, tuple[Address, ...]]:
    if len(names) > MAX_NAMES:
        raise invalid(field, f"at most {MAX_NAMES} names")
    out: dict[str, tuple[Address, ...]] = {}
    for name, addresses in names.items():
        where = f"{field}[{name}]"
        if not isinstance(name, str) or not is_label(name):
            raise invalid(where, _LABEL_RULE)
        if isinstance(addresses, str):
            raise invalid(where, "addresses must be a list, not one string")
        parsed = tuple(_address(f"{where}.addresses[{i}]", a) for i, a in enumerate(addresses))
        if not 1 <= len(parsed) <= MAX_ADDRESSES:
            raise invalid(where, f"must have 1 to {MAX_ADDRESSES} addresses")
        out[name] = tuple(dict.fromkeys(parsed))
    return types.MappingProxyType(out)


def _includes(table_id: str, includes: Sequence[str]) -> tuple[str, ...]:
    if len(includes) > MAX_INCLUDES:
        raise invalid("includes", f"at most {MAX_INCLUDES} tables")
    for i, included in enumerate(includes):
        if not isinstance(included, str) or not is_label(included):
            raise invalid(f"includes[{i}]", _LABEL_RULE)
        if included == table_id:
            raise invalid(f"includes[{i}]", "a table cannot include itself")
        if included in includes[:i]:
            raise invalid(f"includes[{i}]", f"{included} is included twice")
    return tuple(includes)


def _version(field: str, version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise invalid(field, "must be an integer from 0 to 2^64-1")
    return version


@attrs.frozen(eq=True)
class NameTable:
    """A validated name table; build it with NameTable.parse (or the constructor, which checks)."""

    id: str
    version: int
    names: Mapping[str, tuple[Address, ...]] = attrs.field(eq=False, hash=False)
    includes: tuple[str, ...] = ()

    # The mapping proxy compares by identity: compare the contents instead.
    _names_key: tuple[tuple[str, tuple[Address, ...]], ...] = attrs.field(
        init=False, repr=False, eq=True
    )

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.id, str) or not is_label(self.id):
            raise invalid("id", _LABEL_RULE)
        _version("version", self.version)
        object.__setattr__(self, "names", _names("names", self.names))
        object.__setattr__(self, "includes", _includes(self.id, tuple(self.includes)))
        object.__setattr__(self, "_names_key", tuple(sorted(self.names.items())))

    @classmethod
    def parse(
        cls,
        id: str,
        version: int,
        names: Mapping[str, Iterable[object]],
        includes: Sequence[str] = (),
    ) -> NameTable:
        """A table from outside input (addresses as text or ipaddress objects); raises invalid."""
        return cls(id=id, version=version, names=names, includes=tuple(includes))  # type: ignore[arg-type]

    def get(self, name: str) -> tuple[Address, ...] | None:
        """This table's own addresses of a name (lowercase label), without its includes."""
        return self.names.get(name)


@attrs.frozen
class NameTableDelta:
    """An UpdateNameTable: from the version the node has to another, names put and removed."""

    table_id: str
    from_version: int
    to_version: int
    put: Mapping[str, Iterable[object]] = attrs.field(factory=dict, eq=False, hash=False)
    removed: tuple[str, ...] = ()


def apply_delta(table: NameTable, delta: NameTableDelta) -> NameTable:
    """The table after the delta; FAILED_PRECONDITION unless the table is at delta.from_version."""
    _version("from_version", delta.from_version)
    _version("to_version", delta.to_version)
    if delta.table_id != table.id:
        raise invalid("id", f"the delta is for table {delta.table_id}, not {table.id}")
    if table.version != delta.from_version:
        raise FeosError(
            Code.FAILED_PRECONDITION,
            f"name table {table.id}: the delta goes from version {delta.from_version} "
            f"but the node has version {table.version}",
        )
    put = _names("put", delta.put)
    for i, name in enumerate(delta.removed):
        if not isinstance(name, str) or not is_label(name):
            raise invalid(f"removed[{i}]", _LABEL_RULE)
        if name in put:
            raise invalid(f"removed[{i}]", f"{name} is both put and removed")
    names = {n: a for n, a in table.names.items() if n not in delta.removed}
    names.update(put)
    return NameTable(id=table.id, version=delta.to_version, names=names, includes=table.includes)


def lookup_name(
    name: str, pod_tables: Sequence[str], tables: Mapping[str, NameTable]
) -> tuple[Address, ...] | None:
    """The addresses that a pod's tables give a queried name, or None if none of them holds it.

    `name` is the query's name without the root: one label matches in any ASCII case, more labels
    never do. `tables` is the node's tables by ID; a missing one holds nothing.
    """
    if "." in name or not name:
        return None
    label = name.lower()
    for table_id in pod_tables:
        table = tables.get(table_id)
        if table is None:
            continue
        found = _in_table(label, table, tables)
        if found is not None:
            return found
    return None


def _in_table(
    label: str, table: NameTable, tables: Mapping[str, NameTable]
) -> tuple[Address, ...] | None:
    own = table.get(label)
    if own is not None:
        return own
    for included_id in table.includes:
        included = tables.get(included_id)
        if included is not None and (found := included.get(label)) is not None:
            return found
    return None
