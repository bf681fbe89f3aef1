"""feosctl's nouns and verbs: each verb builds a call, and its answer is printed by `output`."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from ..rpc import Client


class UsageError(Exception):
    """A command line that cannot become a call (a bad size, a spec file that does not parse)."""


class Table:
    """An answer for people: columns, rows; `data` is what --json prints."""

    def __init__(self, data: Any, columns: list[str], rows: list[list[str]]) -> None:
        self.data = data
        self.columns = columns
        self.rows = rows


def output(args: argparse.Namespace, result: Any) -> None:
    if result is None:
        return
    if args.json:
        data = result.data if isinstance(result, Table) else result
        json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")
    elif isinstance(result, Table):
        print_table(result.columns, result.rows)
    elif isinstance(result, str):
        print(result)
    else:
        json.dump(result, sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    for row in [columns, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


_SIZE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB|TiB|K|M|G|T)?", re.IGNORECASE)
_UNITS = {"b": 0, "k": 10, "kib": 10, "m": 20, "mib": 20, "g": 30, "gib": 30, "t": 40, "tib": 40}


def parse_size(text: str) -> int:
    """A size such as 512MiB, 1G or 1073741824 (bytes)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UsageError(f"--size: {text!r} is not a size such as 512MiB or 10GiB")
    unit = (match.group(2) or "b").lower()
    return int(match.group(1)) << _UNITS[unit]


def human_size(size: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size}B"


def parse_pairs(items: list[str], what: str) -> list[dict[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{what}: {item!r} is not KEY=VALUE")
        pairs.append({"key": key, "value": value})
    return pairs


def load_file(path: str) -> Any:
    """A JSON or YAML document from a file ('-' for stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from exc
    import yaml  # here: only spec files need it, and every feosctl start would pay its import

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not JSON or YAML: {exc}") from exc


def _verb(verbs: Any, name: str, handler: Any, help: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = verbs.add_parser(name, help=help, description=help)
    p.set_defaults(handler=handler)
    return p


def _noun(nouns: Any, name: str, help: str) -> Any:
    p = nouns.add_parser(name, help=help, description=help)
    return p.add_subparsers(dest="verb", required=True, metavar="VERB")


# -- volume ------------------------------------------------------------------------------------


def volume_row(v: dict[str, Any]) -> list[str]:
    labels = ",".join(f"{lb['key']}={lb.get('value', '')}" for lb in v.get("labels", []))
    return [
        v["id"],
        human_size(v.get("sizeBytes", 0)),
        v.get("state", ""),
        v.get("podId", ""),
        "yes" if v.get("formatted") else "no",
        labels,
    ]


VOLUME_COLUMNS = ["ID", "SIZE", "STATE", "POD", "FORMATTED", "LABELS"]


async def volume_create(client: Client, args: argparse.Namespace) -> Table:
    r = await client.call(
        "volumes",
        "createVolume",
        id=args.id,
        sizeBytes=parse_size(args.size),
        labels=parse_pairs(args.label, "--label"),
    )
    v = r.volume.to_dict()
    return Table(v, VOLUME_COLUMNS, [volume_row(v)])


async def volume_get(client: Client, args: argparse.Namespace) -> Table:
    v = (await client.call("volumes", "getVolume", id=args.id)).volume.to_dict()
    return Table(v, VOLUME_COLUMNS, [volume_row(v)])


async def volume_list(client: Client, args: argparse.Namespace) -> Table:
    r = await client.call("volumes", "listVolumes")
    vs = [v.to_dict() for v in r.volumes]
    return Table(vs, VOLUME_COLUMNS, [volume_row(v) for v in vs])


async def volume_delete(client: Client, args: argparse.Namespace) -> str:
    await client.call("volumes", "deleteVolume", id=args.id)
    return f"volume {args.id} deleted"


def register_volume(nouns: Any) -> None:
    verbs = _noun(nouns, "volume", "volumes: disks that outlive their pods")
    p = _verb(verbs, "create", volume_create, "record a volume (its disk is made at first boot)")
    p.add_argument("id", help="a lowercase UUID")
    p.add_argument("--size", required=True, help="64MiB to 16TiB in whole MiB, such as 10GiB")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    _verb(verbs, "get", volume_get, "show a volume").add_argument("id")
    _verb(verbs, "list", volume_list, "list the volumes")
    _verb(verbs, "delete", volume_delete, "delete a volume no pod has, with its disk").add_argument(
        "id"
    )


# -- group -------------------------------------------------------------------------------------


def rule_text(rule: dict[str, Any]) -> str:
    peer = rule.get("peer", {})
    if "group" in peer:
        target = f"group {peer['group']}"
    else:
        block = peer.get("block", {})
        excepts = block.get("except", [])
        target = block.get("cidr", "") + (f" except {','.join(excepts)}" if excepts else "")
    ports = ""
    if rule.get("firstPort"):
        first, last = rule["firstPort"], rule.get("lastPort", rule["firstPort"])
        ports = f":{first}" if first == last else f":{first}-{last}"
    return f"{rule.get('protocol', 'any')}{ports} {target}"


def group_rows(g: dict[str, Any]) -> list[list[str]]:
    rows = [[g["id"], "in", rule_text(r)] for r in g.get("rulesIn", [])]
    rows += [[g["id"], "out", rule_text(r)] for r in g.get("rulesOut", [])]
    return rows or [[g["id"], "", "(no rules)"]]


GROUP_COLUMNS = ["ID", "DIRECTION", "RULE"]


async def group_put(client: Client, args: argparse.Namespace) -> Table:
    group = load_file(args.file)
    if not isinstance(group, dict):
        raise UsageError(f"{args.file}: a security group is a mapping with id, rulesIn, rulesOut")
    g = (await client.call("securityGroups", "putSecurityGroup", group=group)).group.to_dict()
    return Table(g, GROUP_COLUMNS, group_rows(g))


async def group_get(client: Client, args: argparse.Namespace) -> Table:
    g = (await client.call("securityGroups", "getSecurityGroup", id=args.id)).group.to_dict()
    return Table(g, GROUP_COLUMNS, group_rows(g))


async def group_list(client: Client, args: argparse.Namespace) -> Table:
    gs = [g.to_dict() for g in (await client.call("securityGroups", "listSecurityGroups")).groups]
    return Table(gs, GROUP_COLUMNS, [row for g in gs for row in group_rows(g)])


async def group_delete(client: Client, args: argparse.Namespace) -> str:
    await client.call("securityGroups", "deleteSecurityGroup", id=args.id)
    return f"security group {args.id} deleted"


def register_group(nouns: Any) -> None:
    verbs = _noun(nouns, "group", "security groups: what pods may reach and be reached by")
    _verb(
        verbs, "put", group_put, "put a group from a JSON or YAML file ('-': stdin)"
    ).add_argument("file")
    _verb(verbs, "get", group_get, "show a group").add_argument("id")
    _verb(verbs, "list", group_list, "list the groups")
    _verb(verbs, "delete", group_delete, "delete a group no pod names").add_argument("id")


# -- names -------------------------------------------------------------------------------------


def table_rows(t: dict[str, Any]) -> list[list[str]]:
    rows = [
        [t["id"], str(t.get("version", 0)), n["name"], ",".join(n.get("addresses", []))]
        for n in t.get("names", [])
    ]
    for include in t.get("includes", []):
        rows.append([t["id"], str(t.get("version", 0)), f"(includes {include})", ""])
    return rows or [[t["id"], str(t.get("version", 0)), "(no names)", ""]]


NAMES_COLUMNS = ["TABLE", "VERSION", "NAME", "ADDRESSES"]


def parse_names(items: list[str]) -> list[dict[str, Any]]:
    names = []
    for item in items:
        name, sep, addresses = item.partition("=")
        if not sep:
            raise UsageError(f"--put: {item!r} is not NAME=ADDRESS[,ADDRESS...]")
        names.append({"name": name, "addresses": [a for a in addresses.split(",") if a]})
    return names


async def names_put(client: Client, args: argparse.Namespace) -> Table:
    table = load_file(args.file)
    if not isinstance(table, dict):
        raise UsageError(
            f"{args.file}: a name table is a mapping with id, version, names, includes"
        )
    t = (await client.call("names", "putNameTable", table=table)).table.to_dict()
    return Table(t, NAMES_COLUMNS, table_rows(t))


async def names_update(client: Client, args: argparse.Namespace) -> Table:
    r = await client.call(
        "names",
        "updateNameTable",
        id=args.id,
        fromVersion=args.from_version,
        toVersion=args.to_version,
        put=parse_names(args.put),
        remove=args.remove,
    )
    t = r.table.to_dict()
    return Table(t, NAMES_COLUMNS, table_rows(t))


async def names_get(client: Client, args: argparse.Namespace) -> Table:
    t = (await client.call("names", "getNameTable", id=args.id)).table.to_dict()
    return Table(t, NAMES_COLUMNS, table_rows(t))


async def names_list(client: Client, args: argparse.Namespace) -> Table:
    ts = [t.to_dict() for t in (await client.call("names", "listNameTables")).tables]
    return Table(ts, NAMES_COLUMNS, [row for t in ts for row in table_rows(t)])


async def names_delete(client: Client, args: argparse.Namespace) -> str:
    await client.call("names", "deleteNameTable", id=args.id)
    return f"name table {args.id} deleted"


def register_names(nouns: Any) -> None:
    verbs = _noun(nouns, "names", "name tables: names the pods' resolver answers itself")
    _verb(
        verbs, "put", names_put, "put a table from a JSON or YAML file ('-': stdin)"
    ).add_argument("file")
    p = _verb(verbs, "update", names_update, "change a table from the version the node has")
    p.add_argument("id")
    p.add_argument("--from", dest="from_version", type=int, required=True, metavar="VERSION")
    p.add_argument("--to", dest="to_version", type=int, required=True, metavar="VERSION")
    p.add_argument("--put", action="append", default=[], metavar="NAME=ADDRESS[,ADDRESS]")
    p.add_argument("--remove", action="append", default=[], metavar="NAME")
    _verb(verbs, "get", names_get, "show a table").add_argument("id")
    _verb(verbs, "list", names_list, "list the tables")
    _verb(verbs, "delete", names_delete, "delete a table no pod names").add_argument("id")


# -- host --------------------------------------------------------------------------------------


async def host_info(client: Client, args: argparse.Namespace) -> Table:
    info = (await client.call("host", "getHostInfo")).info.to_dict()
    version = info.get("version", {})
    feosd = f"{version.get('feosd', '')} (pid {info.get('pid', 0)}"
    rows = [
        ["hostname", info.get("hostname", "")],
        ["kernel", info.get("kernel", "")],
        ["feosd", f"{feosd}, python {version.get('python', '')})"],
        ["self-upgrade", "yes" if info.get("selfUpgrade") else "no"],
        *_vmm_rows(info.get("vmm", {})),
        ["network", version.get("network", "") or "-"],
        ["mesh device", info.get("meshDevice", "") or "-"],
        ["guests", ", ".join(version.get("guests", [])) or "-"],
        ["firecrackers", ", ".join(version.get("firecrackers", [])) or "-"],
    ]
    return Table(info, ["FIELD", "VALUE"], rows)


_VMM_NAMES = {"qemu": "QEMU", "firecracker": "Firecracker"}


def _vmm_rows(vmm: dict[str, Any]) -> list[list[str]]:
    """The node's VMM: which, under what, why, what --vmm asked, and the microVMs by VMM."""
    driver = vmm.get("driver", "")
    which = f"{_VMM_NAMES.get(driver, driver)} under {vmm.get('accel', '').upper()}"
    counts = ", ".join(f"{_VMM_NAMES.get(c.get('driver', ''), c.get('driver', ''))} "
                       f"{c.get('count', 0)}" for c in vmm.get("microvms", []))
    return [["vmm", which if driver else "-"],
            ["vmm reason", vmm.get("reason", "") or "-"],
            ["vmm asked", f"--vmm {vmm['requested']}" if vmm.get("requested") else "-"],
            ["microvms", counts or "none"]]


def _when(unix_ns: int) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_ns / 1e9)) if unix_ns else "-"


async def host_control_plane(client: Client, args: argparse.Namespace) -> Table:
    info = (await client.call("host", "getControlPlane")).info.to_dict()
    if not info.get("configured"):
        return Table(info, ["FIELD", "VALUE"], [["control plane", "none (no --control-plane)"]])
    ident, up = info.get("identity", {}), info.get("uplink", {})
    mesh = (f"{up.get('meshUla')}, the node's {up.get('meshPrefix')}" if up.get("meshed")
            else "-")
    rows = [
        ["control plane", info.get("controlPlane", "")],
        ["node", ident.get("name", "") or "not joined"],
        ["spiffe id", ident.get("spiffeId", "") or "-"],
        ["certificate ends", _when(ident.get("notAfterUnixNs", 0))],
        ["renewal", _when(ident.get("renewUnixNs", 0))],
        ["uplink", f"{up.get('state', '')} {up.get('instance', '')}".strip()],
        ["last report", _when(up.get("lastReportUnixNs", 0))
         + (" (held: the 90 s rule)" if up.get("reportsHeld") else "")],
        ["events", f"{up.get('eventsPending', 0)} pending, {up.get('eventsDropped', 0)} dropped"],
        ["mesh", mesh],
        ["last error", up.get("lastError", "") or "-"],
    ]
    for c in info.get("connections", []):
        rows.append([f"connection {c.get('address', '')}",
                     f"{c.get('state', '')}, {c.get('streams', 0)} streams"
                     + (f", {c['detail']}" if c.get("detail") else "")])
    return Table(info, ["FIELD", "VALUE"], rows)


async def host_reboot(client: Client, args: argparse.Namespace) -> str:
    await client.call("host", "reboot")
    return "the node reboots"


async def host_shutdown(client: Client, args: argparse.Namespace) -> str:
    await client.call("host", "shutdown")
    return "the node powers off"


async def host_upgrade(client: Client, args: argparse.Namespace) -> str:
    import hashlib

    try:  # a file the operator names, read before the call: the one-shot CLI has nothing to wait on
        binary = Path(args.binary).read_bytes()  # noqa: ASYNC240
    except OSError as exc:
        raise UsageError(f"{args.binary}: {exc.strerror}") from exc
    digest = args.sha256 or hashlib.sha256(binary).hexdigest()
    await client.call("host", "upgradeFeosBinary", binary=binary, sha256=digest)
    return f"feosd upgrades to {args.binary} (sha256 {digest})"


def register_host(nouns: Any) -> None:
    verbs = _noun(nouns, "host", "the node itself")
    _verb(verbs, "info", host_info, "versions, the VMM (and why) and the network of this node")
    _verb(verbs, "control-plane", host_control_plane,
          "the control-plane link: the identity, the node connections, the uplink")
    _verb(verbs, "reboot", host_reboot, "reboot the node (PID 1 gets SIGRTMIN+5)")
    _verb(verbs, "shutdown", host_shutdown, "power the node off (PID 1 gets SIGRTMIN+4)")
    p = _verb(verbs, "upgrade", host_upgrade, "replace feosd's program and re-execute it")
    p.add_argument("binary", help="the new feosd program")
    p.add_argument("--sha256", help="its expected sha256 (default: computed here)")


# -- mesh --------------------------------------------------------------------------------------


async def mesh_show(client: Client, args: argparse.Namespace) -> Table:
    import base64

    mesh = (await client.call("mesh", "getMesh")).mesh.to_dict()
    mesh["publicKey"] = base64.b64encode(mesh.get("publicKey", b"")).decode()
    for peer in mesh.setdefault("peers", []):
        peer["publicKey"] = base64.b64encode(peer.get("publicKey", b"")).decode()
    rows = [
        ["ula", mesh.get("ula", "") or "-"],
        ["node prefix", mesh.get("nodePrefix", "") or "-"],
        ["public key", mesh["publicKey"]],
        ["port", str(mesh.get("port", 0))],
        ["version", str(mesh.get("version", 0))],
        *[["peer", f"{p['publicKey']} {p.get('endpoint', '')} {p.get('prefix', '')}"]
          for p in mesh["peers"]],
    ]
    return Table(mesh, ["FIELD", "VALUE"], rows)


def register_mesh(nouns: Any) -> None:
    verbs = _noun(nouns, "mesh", "the cluster's mesh: feos-mesh, its prefixes and its peers")
    _verb(verbs, "show", mesh_show, "the node's prefixes, key, port, version and peers")


def _register_pod(nouns: Any) -> None:
    from ._pods import register_pod

    register_pod(nouns)


def _register_traffic(nouns: Any) -> None:
    from ._traffic import register_traffic

    register_traffic(nouns)


def _register_template(nouns: Any) -> None:
    from ._templates import register_template

    register_template(nouns)


NOUNS = [_register_pod, register_volume, register_group, register_names, register_host,
         _register_traffic, register_mesh, _register_template]
