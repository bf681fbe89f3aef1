"""diskd's files, blocking (run on worker threads): records, layers, tops, and qemu-img.

<state>/layers/sha256-<hex> is a layer (0444, never written again) and sha256-<hex>.json its
record; <state>/disks/<id>/ is a disk: disk.json, its top (top.qcow2, or top.raw when taken over
from a plain file), and a hard link of every layer of its stack under the layer's own name, so
that the top's backing name (the base's file name, relative) resolves in the disk's directory,
and in any directory the VMM links the same names into (a chroot). Every record is written whole
and fsynced (feos.records.write_whole); a directory that appears does so by one rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import Code, FeosError
from ..records import fsync_dir, remove_whole, write_whole
from ._model import Disk, Layer, layer_file

RECORD = "disk.json"
QEMU_IMG = "qemu-img"
# A new top's qcow2 format (docs/disk.md, "A top's format", measured there): 1 MiB clusters, so
# that a guest's first sequential write allocates (one L2 entry, one refcount) per MiB rather
# than per 64 KiB; extended L2 entries, so that a small write to a new cluster still copies
# only its 32 KiB subcluster up from the layer beneath; refcounts written as they change
# (lazy_refcounts=off: a crash needs no repair, what the guest flushed is consistent on disk).
# Tops made before keep the format they were made with: QEMU reads it from their header.
TOP_OPTIONS = "cluster_size=1M,extended_l2=on,lazy_refcounts=off"


def run(argv: list[str], what: str, *, code: Code = Code.INTERNAL) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise FeosError(Code.FAILED_PRECONDITION, f"{what}: {argv[0]} is not installed") from exc
    if done.returncode != 0:
        raise FeosError(code, f"{what}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_whole(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


class Files:
    """The state directory's layout and its blocking steps."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers = root / "layers"
        self.disks = root / "disks"

    def prepare(self) -> None:
        for d in (self.root, self.layers, self.disks):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.layers, 0o755)  # every microVM's user reads the layers through it
        os.chmod(self.disks, 0o755)
        os.chmod(self.root, 0o755)

    # -- records ---------------------------------------------------------------------------

    def load_layers(self) -> dict[str, Layer]:
        found = {}
        for path in sorted(self.layers.glob("sha256-*.json")):
            layer = Layer.from_json(json.loads(path.read_text()))
            if (self.layers / layer.file).exists():
                found[layer.digest] = layer
        return found

    def load_disks(self) -> dict[str, Disk]:
        found = {}
        for path in sorted(self.disks.glob(f"*/{RECORD}")):
            if path.parent.name.startswith("."):
                continue
            disk = Disk.from_json(json.loads(path.read_text()))
            found[disk.id] = disk
        return found

    def keep_disk(self, disk: Disk) -> None:
        write_json(self.disk_dir(disk.id) / RECORD, disk.to_json())

    def disk_dir(self, disk_id: str) -> Path:
        return self.disks / disk_id

    # -- layers ----------------------------------------------------------------------------

    def layer_path(self, digest: str) -> Path:
        return self.layers / layer_file(digest)

    def tmp(self, name: str) -> Path:
        path = self.layers / f".{name}.{os.getpid()}.tmp"
        path.unlink(missing_ok=True)
        return path

    def record_layer(self, layer: Layer) -> None:
        """A layer's record (its file is in place: pulled, or registered)."""
        write_json(self.layers / f"{layer.file}.json", layer.to_json())

    def register(self, tmp: Path, layer: Layer) -> Layer:
        """A finished layer file named by its digest, read-only, with its record."""
        os.chmod(tmp, 0o444)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, self.layer_path(layer.digest))
        write_json(self.layers / f"{layer.file}.json", layer.to_json())  # fsyncs the directory
        return layer

    def ensure_empty(self) -> Layer:
        from ._model import EMPTY_DIGEST

        layer = Layer(EMPTY_DIGEST, "", "raw", 0, 0)
        if not self.layer_path(EMPTY_DIGEST).exists() or not self._has_record(layer):
            tmp = self.tmp("empty")
            tmp.touch()
            self.register(tmp, layer)
        return layer

    def _has_record(self, layer: Layer) -> bool:
        return (self.layers / f"{layer.file}.json").exists()

    def unpack(self, source: Path, digest: str) -> Path:
        """The raw image of a .zst, sparse, as a temporary file of the layers' directory."""
        tmp = self.tmp(layer_file(digest))
        try:
            run(["zstd", "-q", "-d", "--sparse", "-f", "-o", str(tmp), str(source)],
                f"{source} does not unpack", code=Code.INVALID_ARGUMENT)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def copy_in(self, source: Path, name: str) -> Path:
        """A sparse copy (a reflink where the filesystem has them) as a temporary layer file."""
        tmp = self.tmp(name)
        try:
            run(["cp", "--sparse=always", "--reflink=auto", str(source), str(tmp)],
                f"{source} does not copy")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def remove_layer(self, digest: str) -> int:
        path = self.layer_path(digest)
        freed = allocated(path)
        remove_whole(self.layers / f"{layer_file(digest)}.json")
        path.unlink(missing_ok=True)
        return freed

    # -- disks -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _aside(self, disk: Disk, why: str) -> Iterator[Path]:
        """A disk's directory made aside (`.ID.why`), filled by the body, then its record written
        and the directory renamed in at once; removed if the body fails."""
        work = self.disks / f".{disk.id}.{why}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o755)
        try:
            yield work
            write_json(work / RECORD, disk.to_json())
            os.rename(work, self.disk_dir(disk.id))
            fsync_dir(self.disks)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise

    def make_disk(self, disk: Disk, base: Layer) -> None:
        """The disk's directory: its chain's links and an empty top."""
        with self._aside(disk, "new") as work:
            for digest in disk.layers:
                os.link(self.layer_path(digest), work / layer_file(digest))
            top = work / disk.top
            run([QEMU_IMG, "create", "-q", "-f", "qcow2", "-o", TOP_OPTIONS,
                 "-b", base.file, "-F", base.format, str(top), str(disk.size_bytes)],
                f"the top of disk {disk.id} was not made")
            # qemu-img writes its tables' clusters whole, zeroes mostly (3 MiB at 1 MiB
            # clusters): holes read the same, and a new disk costs no more than its header.
            run(["fallocate", "--dig-holes", str(top)], f"the top of disk {disk.id} was not made")

    def adopt(self, disk: Disk, source: Path) -> None:
        """A plain file taken in as the disk's raw top: linked in, the directory renamed in, and
        only then the old name removed. A crash leaves the old name, the new, or both (one
        inode): never a copy, never nothing."""
        with self._aside(disk, "adopt") as work:
            try:
                os.link(source, work / disk.top)
            except OSError as exc:
                raise FeosError(Code.FAILED_PRECONDITION,
                                f"{source} cannot move into {self.disks} without a copy: "
                                f"{exc.strerror}") from exc
        source.unlink()
        fsync_dir(source.parent)

    def remove_disk(self, disk_id: str) -> None:
        final = self.disk_dir(disk_id)
        if not final.exists():
            return
        doomed = self.disks / f".{disk_id}.deleted"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(final, doomed)  # the disk is gone at once, whatever the removal takes
        fsync_dir(self.disks)
        shutil.rmtree(doomed, ignore_errors=True)

    def clear_leftovers(self) -> None:
        """What a crash left half made: new disks, deleted ones, temporary layer files."""
        for path in list(self.disks.glob(".*")):
            shutil.rmtree(path, ignore_errors=True)
        for path in list(self.layers.glob(".*.tmp")):
            path.unlink(missing_ok=True)
