"""diskd's model, pure: layers and disks as values, their names, their stacks, what a collect takes.

A layer is a read-only file in <state>/layers/ named by its digest ("sha256:<hex>" becomes the
file name "sha256-<hex>": a colon in a file name reads as a protocol to QEMU), with a record
beside it (<name>.json). A disk is a writable top over the stack of layers beneath it (nearest
first). Nothing here does I/O: the records are read and written by feos.disk._state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ..errors import Code, FeosError, invalid

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
KINDS = ("pod", "volume")
VMMS = ("qemu", "firecracker")
MAX_SIZE = 16 << 40  # 16 TiB, a volume's largest
EMPTY_DIGEST = "sha256:" + "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""The volumes' empty L0: a file of no bytes (a qcow2 top reads zeroes past its backing's end)."""


def layer_file(digest: str) -> str:
    """The file name of a layer: "sha256-<hex>"."""
    check_digest(digest)
    return digest.replace(":", "-", 1)


def check_digest(digest: str, field: str = "digest") -> str:
    if not DIGEST_RE.fullmatch(digest):
        raise invalid(field, f"{digest!r} is not sha256:<64 lowercase hex digits>")
    return digest


def check_id(disk_id: str) -> str:
    if not ID_RE.fullmatch(disk_id):
        raise invalid("id", f"{disk_id!r} is not a pod's ID or a volume's UUID "
                      "(letters, digits, - and _, at most 128)")
    return disk_id


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise invalid("kind", f"{kind!r} is not pod or volume")
    return kind


def check_vmm(vmm: str) -> str:
    if vmm not in VMMS:
        raise invalid("vmm", f"{vmm!r} is not qemu or firecracker")
    return vmm


@attrs.frozen
class Layer:
    digest: str
    parent: str  # "" for an L0
    format: str  # "raw" (an L0) or "qcow2" (a baked layer, its backing the parent's file)
    size_bytes: int
    virtual_bytes: int
    guest: str = ""
    image: str = ""
    pushed: bool = False
    created_unix_ns: int = 0

    @property
    def file(self) -> str:
        return layer_file(self.digest)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Layer:
        fields = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in fields})

    def answer(self, disks: int) -> dict[str, Any]:
        """As the API's Layer struct."""
        return {"digest": self.digest, "parent": self.parent, "sizeBytes": self.size_bytes,
                "virtualBytes": self.virtual_bytes, "guest": self.guest, "image": self.image,
                "pushed": self.pushed, "disks": disks, "createdUnixNs": self.created_unix_ns}


@attrs.frozen
class Disk:
    id: str
    kind: str
    size_bytes: int
    top: str  # the top's file name in the disk's directory: top.qcow2, or top.raw when adopted
    top_format: str  # "qcow2" or "raw"
    layers: tuple[str, ...] = ()  # the stack beneath the top, nearest first
    state: str = "stopped"
    vmm: str = ""
    owner_uid: int = 0
    data_path_pid: int = 0  # qemu-storage-daemon's, while served raw to Firecracker
    created_unix_ns: int = 0

    @property
    def base(self) -> str:
        return self.layers[0] if self.layers else ""

    @property
    def exported(self) -> bool:
        """Served through a data-path process (a FUSE file of the chain) rather than the top."""
        return self.state == "started" and self.vmm == "firecracker"

    def served_format(self) -> str:
        return "raw" if self.exported else self.top_format

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Disk:
        fields = {f.name for f in attrs.fields(cls)}
        values = {k: v for k, v in raw.items() if k in fields}
        values["layers"] = tuple(values.get("layers", ()))
        return cls(**values)


def stack(layers: Mapping[str, Layer], base: str) -> tuple[str, ...]:
    """The layers from `base` down to its L0, nearest first; NOT_FOUND for one diskd lacks."""
    found: list[str] = []
    digest = base
    while digest:
        layer = layers.get(digest)
        if layer is None:
            beneath = "" if digest == base else f", beneath {base}"
            raise FeosError(Code.NOT_FOUND, f"diskd has no layer {digest}{beneath}")
        if digest in found:
            raise FeosError(Code.DATA_LOSS, f"the layers beneath {base} make a loop at {digest}")
        found.append(digest)
        digest = layer.parent
    return tuple(found)


def disks_on(layers: Iterable[str], disks: Iterable[Disk]) -> dict[str, int]:
    """How many disks stand on each layer (anywhere in their stack)."""
    counts = dict.fromkeys(layers, 0)
    for disk in disks:
        for digest in disk.layers:
            if digest in counts:
                counts[digest] += 1
    return counts


def collectable(layers: Mapping[str, Layer], disks: Iterable[Disk],
                guests: Iterable[str]) -> list[str]:
    """The layers a collect removes, children before their parents: those no disk stands on and
    that no other kept layer stands on, but the empty L0 and the L0s of the guests installed."""
    installed = set(guests)
    keep = {EMPTY_DIGEST}
    for disk in disks:
        keep.update(disk.layers)
    keep.update(d for d, layer in layers.items() if not layer.parent and layer.guest in installed)
    removed: list[str] = []
    children: dict[str, set[str]] = {d: set() for d in layers}
    for digest, layer in layers.items():
        if layer.parent in children:
            children[layer.parent].add(digest)
    # Leaves first: a layer goes once every child of it went; a kept child keeps its parents.
    pending = [d for d in sorted(layers) if not children[d]]
    while pending:
        digest = pending.pop(0)
        if digest in keep:
            continue
        removed.append(digest)
        parent = layers[digest].parent
        if parent in children:
            children[parent].discard(digest)
            if not children[parent]:
                pending.append(parent)
    return removed


def size_for(base: Layer | None, asked: int) -> int:
    """The disk's size: what was asked, but never below its base's."""
    if not 0 <= asked <= MAX_SIZE:
        raise invalid("sizeBytes", f"{asked} is not 0 to 16 TiB")
    floor = base.virtual_bytes if base is not None else 0
    size = max(asked, floor)
    if size == 0:
        raise invalid("sizeBytes", "a disk on the empty layer needs a size")
    return size


def disk_answer(disk: Disk, path: str) -> dict[str, Any]:
    """The disk as the API's Disk struct (allocatedBytes is filled in by the caller); the chain
    is the layers' links beside the top, in the disk's directory (path's)."""
    started = disk.state == "started"
    beside = path.rpartition("/")[0]
    opened = started and not disk.exported
    chain = [f"{beside}/{layer_file(d)}" for d in disk.layers] if opened else []
    return {"chain": chain, "id": disk.id, "kind": disk.kind, "sizeBytes": disk.size_bytes,
            "base": disk.base,
            "layers": list(disk.layers), "state": disk.state, "path": path if started else "",
            "format": disk.served_format(), "ownerUid": disk.owner_uid if started else 0,
            "vmm": disk.vmm if started else "", "dataPathPid": disk.data_path_pid}
