"""`feosctl template list|warm|rm`: the node's pod templates (docs/templates.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ..rpc import Client
from ._commands import Table, UsageError, _noun, _verb

COLUMNS = ["NAME", "GUEST", "VMM", "SHAPE", "NETWORK", "IMAGE", "HELD", "MEMORY"]


def template_row(t: dict[str, Any]) -> list[str]:
    disk = f" disk {t['diskSizeMib']}MiB" if t.get("diskSizeMib") else ""
    return [t["name"], t.get("guestVersion", ""),
            f"{t.get('vmm', '')} {t.get('vmmVersion', '')} {t.get('accel', '')}",
            f"{t.get('vcpus', 0)}x{t.get('memoryMib', 0)}{disk}",
            "yes" if t.get("network") else "no", t.get("image", "") or "-",
            t.get("heldImage", "") or "-", f"{t.get('memoryBytes', 0) >> 20}MiB"]  # fmt: skip


async def template_list(client: Client, args: argparse.Namespace) -> Table:
    r = await client.call("templates", "listTemplates")
    ts = [t.to_dict() for t in r.templates]
    return Table(ts, COLUMNS, [template_row(t) for t in ts])


async def template_warm(client: Client, args: argparse.Namespace) -> Table:
    shape, eq, image = args.shape.partition("=")
    if eq and (not image or args.image):
        raise UsageError(f"{args.shape!r}: the image after '=' is missing, or named twice")
    image = image or args.image or ""
    body, _, net = shape.partition("+")
    try:
        vcpus, memory = (int(x) for x in body.lower().split("x"))
    except ValueError:
        raise UsageError(f"{args.shape!r} is not VCPUSxMEMORY_MIB[+net][=IMAGE]") from None
    if net not in ("", "net"):
        raise UsageError(f"{args.shape!r} is not VCPUSxMEMORY_MIB[+net][=IMAGE]")
    r = await client.call("templates", "warmTemplate", vcpus=vcpus, memoryMib=memory,
                          diskSizeMib=args.disk_size_mib, network=net == "net", image=image)
    t = r.template.to_dict()
    return Table(t, COLUMNS, [template_row(t)])


async def template_rm(client: Client, args: argparse.Namespace) -> str:
    await client.call("templates", "removeTemplate", templateName=args.name)
    return f"template {args.name} removed"


def register_template(nouns: Any) -> None:
    verbs = _noun(nouns, "template", "pod templates: pre-booted guests a create restores")
    _verb(verbs, "list", template_list, "the node's templates")
    p = _verb(verbs, "warm", template_warm, "make the template of a shape now (unless the node "
              "has it)")
    p.add_argument("shape", help="VCPUSxMEMORY_MIB, +net for pods with a network, =IMAGE for "
                   "a template holding that image: 1x512+net, 1x512+net=registry.example/app:1")
    p.add_argument("--image", help="the image the template's guest pulls (anonymously) before "
                   "its snapshot; a create of that image then skips the pull")
    p.add_argument("--disk-size-mib", type=int, default=0,
                   help="the pods' data disk size (default: the guest's)")
    p = _verb(verbs, "rm", template_rm, "remove a template (its pods run on)")
    p.add_argument("name")
