"""SecurityGroupService and NameService: the groups and name tables the node is sent, kept.

Both are stores (feos._store): a change is seen once its record is kept, one change at a time.
A group or table that a pod names cannot be deleted; `in_use(id)` says which pods name it.
Enforcement is the network's (the table's compiler and the resolver read these stores).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _schema
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


def _names(items: list[dict[str, Any]], field: str) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for i, item in enumerate(items):
        name = item.get("name", "")
        if name in names:
            raise invalid(f"{field}[{i}].name", f"{name} is given twice")
        names[name] = list(item.get("addresses", []))
    return names


def table_from_dict(data: dict[str, Any]) -> NameTable:
    return NameTable.parse(
        id=data.get("id", ""),
        version=data.get("version", 0),
        names=_names(data.get("names", []), "names"),
        includes=data.get("includes", []),
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

    async def put_security_group(self, params: dict[str, Any]) -> dict[str, Any]:
        group = group_from_dict(params.get("group", {}))
        async with self.store.lock:
            await self.store.put(group.id, group)
        self.on_change()
        return {"group": group_to_dict(group)}

    async def get_security_group(self, params: dict[str, Any]) -> dict[str, Any]:
        group_id = params.get("id", "")
        validate_group_id(group_id)
        group = self.store.get(group_id)
        if group is None:
            raise _not_found("security group", group_id)
        return {"group": group_to_dict(group)}

    async def list_security_groups(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"groups": [group_to_dict(g) for g in self.store]}

    async def delete_security_group(self, params: dict[str, Any]) -> dict[str, Any]:
        group_id = params.get("id", "")
        validate_group_id(group_id)
        async with self.store.lock:
            if group_id not in self.store:
                raise _not_found("security group", group_id)
            _refuse_in_use("security group", group_id, self._in_use)
            await self.store.remove(group_id)
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

    def _check_id(self, table_id: str) -> None:
        if not is_label(table_id):
            raise invalid("id", "must be one DNS label in lower case (a lowercase UUID is one)")

    async def put_name_table(self, params: dict[str, Any]) -> dict[str, Any]:
        table = table_from_dict(params.get("table", {}))
        async with self.store.lock:
            await self.store.put(table.id, table)
        return {"table": table_to_dict(table)}

    async def update_name_table(self, params: dict[str, Any]) -> dict[str, Any]:
        table_id = params.get("id", "")
        self._check_id(table_id)
        async with self.store.lock:
            table = self.store.get(table_id)
            if table is None:
                raise _not_found("name table", table_id)
            delta = NameTableDelta(
                table_id=table_id,
                from_version=params.get("fromVersion", 0),
                to_version=params.get("toVersion", 0),
                put=_names(params.get("put", []), "put"),
                removed=tuple(params.get("remove", [])),
            )
            updated = apply_delta(table, delta)
            await self.store.put(table_id, updated)
        return {"table": table_to_dict(updated)}

    async def get_name_table(self, params: dict[str, Any]) -> dict[str, Any]:
        table_id = params.get("id", "")
        self._check_id(table_id)
        table = self.store.get(table_id)
        if table is None:
            raise _not_found("name table", table_id)
        return {"table": table_to_dict(table)}

    async def list_name_tables(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"tables": [table_to_dict(t) for t in self.store]}

    async def delete_name_table(self, params: dict[str, Any]) -> dict[str, Any]:
        table_id = params.get("id", "")
        self._check_id(table_id)
        async with self.store.lock:
            if table_id not in self.store:
                raise _not_found("name table", table_id)
            _refuse_in_use("name table", table_id, self._in_use)
            await self.store.remove(table_id)
        return {}

    def close(self) -> None:
        self.store.close()
