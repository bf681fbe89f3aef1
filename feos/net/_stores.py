"""SecurityGroupService and NameService: the groups and name tables the node is sent, kept.

Both are stores (feos._store): a change is seen once its record is kept, one change at a time.
A group or table that a pod names cannot be deleted; `in_use(id)` says which pods name it.
Enforcement is the network's (the table's compiler and the resolver read these stores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from .. import _schema
from .._codec import NoParams, converter, structure_params, takes
from .._store import Store
from ..errors import Code, FeosError, invalid
from ..records import RecordDir
from ._groups import (
    Block,
    GroupPeer,
    Ports,
    Protocol,
    Rule,
    SecurityGroup,
    parse_block,
    validate_group,
    validate_group_id,
)
from ._nametable import NameTable, NameTableDelta, apply_delta, is_label

InUse = Callable[[str], list[str]]

# -- security groups: the wire's dicts and the model ----------------------------------------


def rule_from_dict(data: dict[str, Any], field: str) -> Rule:
    protocol_name = str(data.get("protocol", "any")).upper()
    if protocol_name not in Protocol.__members__:
        raise invalid(f"{field}.protocol", f"must be one of {', '.join(Protocol.__members__)}")
    protocol = Protocol[protocol_name]
    first, last = data.get("firstPort", 0), data.get("lastPort", 0)
    ports = None if first == 0 and last == 0 else Ports(first, last)
    peer_data = data.get("peer", {})
    if "group" in peer_data:
        peer: Block | GroupPeer = GroupPeer(peer_data["group"])
    elif "block" in peer_data:
        block = peer_data["block"]
        peer = parse_block(block.get("cidr", ""), block.get("except", []), f"{field}.peer.block")
    else:
        raise invalid(f"{field}.peer", "must be an address block or a group")
    return Rule(protocol=protocol, peer=peer, ports=ports)


def rule_to_dict(rule: Rule) -> dict[str, Any]:
    out: dict[str, Any] = {"protocol": rule.protocol.name.lower()}
    if rule.ports is not None:
        out["firstPort"], out["lastPort"] = rule.ports.first, rule.ports.last
    if isinstance(rule.peer, GroupPeer):
        out["peer"] = {"group": rule.peer.group_id}
    else:
        out["peer"] = {
            "block": {"cidr": str(rule.peer.cidr), "except": [str(e) for e in rule.peer.excepts]}
        }
    return out


def group_from_dict(data: dict[str, Any]) -> SecurityGroup:
    group_id = data.get("id", "")
    validate_group_id(group_id)
    group = SecurityGroup(
        id=group_id,
        rules_in=tuple(
            rule_from_dict(r, f"rules_in[{i}]") for i, r in enumerate(data.get("rulesIn", []))
        ),
        rules_out=tuple(
            rule_from_dict(r, f"rules_out[{i}]") for i, r in enumerate(data.get("rulesOut", []))
        ),
    )
    validate_group(group)
    return group


def group_to_dict(group: SecurityGroup) -> dict[str, Any]:
    return {
        "id": group.id,
        "rulesIn": [rule_to_dict(r) for r in group.rules_in],
        "rulesOut": [rule_to_dict(r) for r in group.rules_out],
    }


# -- name tables -------------------------------------------------------------------------------


@attrs.frozen
class NameEntry:
    name: str = ""
    addresses: tuple[str, ...] = ()


def _names(items: Sequence[NameEntry], field: str) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for i, item in enumerate(items):
        if item.name in names:
            raise invalid(f"{field}[{i}].name", f"{item.name} is given twice")
        names[item.name] = list(item.addresses)
    return names


@attrs.frozen
class _TableParams:
    id: str = ""
    version: int = 0
    names: tuple[NameEntry, ...] = ()
    includes: tuple[str, ...] = ()


def table_from_dict(data: dict[str, Any]) -> NameTable:
    table = structure_params(data, _TableParams)
    return NameTable.parse(
        id=table.id,
        version=table.version,
        names=_names(table.names, "names"),
        includes=table.includes,
    )


def table_to_dict(table: NameTable) -> dict[str, Any]:
    return {
        "id": table.id,
        "version": table.version,
        "names": [
            {"name": n, "addresses": [str(a) for a in addrs]}
            for n, addrs in sorted(table.names.items())
        ],
        "includes": list(table.includes),
    }


def _refuse_in_use(kind: str, record_id: str, in_use: InUse) -> None:
    pods = in_use(record_id)
    if pods:
        raise FeosError(
            Code.FAILED_PRECONDITION,
            f"{kind} {record_id} is named by pod(s) {', '.join(sorted(pods))}",
        )


def _not_found(kind: str, record_id: str) -> FeosError:
    return FeosError(Code.NOT_FOUND, f"{kind} {record_id} does not exist")


# -- the calls' params, structured at the API's edge (feos._codec.takes) ---------------------


def _checked_group_id(_instance: Any, _attribute: Any, value: str) -> None:
    validate_group_id(value)


def _checked_table_id(_instance: Any, _attribute: Any, value: str) -> None:
    if not is_label(value):
        raise invalid("id", "must be one DNS label in lower case (a lowercase UUID is one)")


converter.register_structure_hook(SecurityGroup, lambda data, _cls: group_from_dict(data))
converter.register_structure_hook(NameTable, lambda data, _cls: table_from_dict(data))


@attrs.frozen
class PutSecurityGroup:
    group: SecurityGroup


@attrs.frozen
class GroupId:
    id: str = attrs.field(default="", validator=_checked_group_id)


@attrs.frozen
class PutNameTable:
    table: NameTable


@attrs.frozen
class TableId:
    id: str = attrs.field(default="", validator=_checked_table_id)


@attrs.frozen
class UpdateNameTable:
    id: str = attrs.field(default="", validator=_checked_table_id)
    from_version: int = 0
    to_version: int = 0
    put: tuple[NameEntry, ...] = ()
    remove: tuple[str, ...] = ()


class SecurityGroupService:
    def __init__(self, state_dir: Path, in_use: InUse) -> None:
        self.store: Store[SecurityGroup] = Store(
            RecordDir(
                state_dir / "security-groups",
                _schema.network().SecurityGroup,
                thread_name="group-records",
            ),
            group_to_dict,
            group_from_dict,
        )
        self._in_use = in_use
        self.on_change: Callable[[], None] = lambda: None

    def load(self) -> None:
        self.store.load()

    @takes(PutSecurityGroup)
    async def put_security_group(self, call: PutSecurityGroup) -> dict[str, Any]:
        async with self.store.lock:
            await self.store.put(call.group.id, call.group)
        self.on_change()
        return {"group": group_to_dict(call.group)}

    @takes(GroupId)
    async def get_security_group(self, call: GroupId) -> dict[str, Any]:
        group = self.store.get(call.id)
        if group is None:
            raise _not_found("security group", call.id)
        return {"group": group_to_dict(group)}

    @takes(NoParams)
    async def list_security_groups(self, call: NoParams) -> dict[str, Any]:
        return {"groups": [group_to_dict(g) for g in self.store]}

    @takes(GroupId)
    async def delete_security_group(self, call: GroupId) -> dict[str, Any]:
        async with self.store.lock:
            if call.id not in self.store:
                raise _not_found("security group", call.id)
            _refuse_in_use("security group", call.id, self._in_use)
            await self.store.remove(call.id)
        self.on_change()
        return {}

    def close(self) -> None:
        self.store.close()


class NameTableService:
    def __init__(self, state_dir: Path, in_use: InUse) -> None:
        self.store: Store[NameTable] = Store(
            RecordDir(
                state_dir / "name-tables",
                _schema.network().NameTable,
                thread_name="name-table-records",
            ),
            table_to_dict,
            table_from_dict,
        )
        self._in_use = in_use

    def load(self) -> None:
        self.store.load()

    def tables(self) -> dict[str, NameTable]:
        return dict(self.store.items())

    @takes(PutNameTable)
    async def put_name_table(self, call: PutNameTable) -> dict[str, Any]:
        async with self.store.lock:
            await self.store.put(call.table.id, call.table)
        return {"table": table_to_dict(call.table)}

    @takes(UpdateNameTable)
    async def update_name_table(self, call: UpdateNameTable) -> dict[str, Any]:
        async with self.store.lock:
            table = self.store.get(call.id)
            if table is None:
                raise _not_found("name table", call.id)
            delta = NameTableDelta(
                table_id=call.id,
                from_version=call.from_version,
                to_version=call.to_version,
                put=_names(call.put, "put"),
                removed=call.remove,
            )
            updated = apply_delta(table, delta)
            await self.store.put(call.id, updated)
        return {"table": table_to_dict(updated)}

    @takes(TableId)
    async def get_name_table(self, call: TableId) -> dict[str, Any]:
        table = self.store.get(call.id)
        if table is None:
            raise _not_found("name table", call.id)
        return {"table": table_to_dict(table)}

    @takes(NoParams)
    async def list_name_tables(self, call: NoParams) -> dict[str, Any]:
        return {"tables": [table_to_dict(t) for t in self.store]}

    @takes(TableId)
    async def delete_name_table(self, call: TableId) -> dict[str, Any]:
        async with self.store.lock:
            if call.id not in self.store:
                raise _not_found("name table", call.id)
            _refuse_in_use("name table", call.id, self._in_use)
            await self.store.remove(call.id)
        return {}

    def close(self) -> None:
        self.store.close()
