"""Pod templates (docs/templates.md): a create that restores a guest that booted already.

Theory of operation. A template is a snapshot of a guest that booted, attached and stopped
before any container, for one key: everything the snapshot fixes (the guest version, the VMM
and its version, the accelerator, the shape: vCPUs, memory, the data disk's size, the number of
drives, a network device or none) and the layer its disk is made on (the guest's blank data
volume, or a layer baked of the pod's image: the image then is in the template too), and the
image its guest pulled anonymously before the snapshot, if it holds one (a create of it pulls it
again with its own token first: the manifest only, for the digest held). It lives
in <state>/templates/<name>/: template.json (the key, the digests) and memory (QEMU's migration
stream), and in diskd as a layer: the template's disk sealed while its VM was suspended, which
a disk of the template's own name, `keep`, stands on so that diskd never collects it.

    making  -> a microVM of the template's name boots on a disk made on the key's base, its
               guest attaches; it is suspended (the migration flushes the disk); the disk's top
               is sealed as a layer (diskd's bake), the disk made again on that layer; the
               memory moved in, its digest kept; the microVM deleted
    ready   -> a create whose spec fits makes its disk on the template's layer (no copy), its
               microVM on the same shape, seeded with the memory (a hard link) and resumed
    dropped -> removed (RemoveTemplate), its guest version gone, its VMM's version changed, or
               damaged: its memory or its layer missing, or the memory's digest another

One make per key at a time: a create that finds its template being made boots cold, and so
does the create that finds none (it starts the make when the node makes templates on first
use). A template found damaged is dropped and made again in the background; the create boots
cold meanwhile. Pods restored from a template keep running when it is removed: their disks
stand on its layer (diskd keeps a layer a disk stands on) and their memory is their own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import trio

from .._digest import sha256_file
from ..errors import Code, FeosError, invalid
from ._disks import DiskdPort
from ._network import PodNet, PodNetworkService
from ._pod import Pod
from ._ports import MicroVmsPort

log = logging.getLogger(__name__)

TEMPLATE_MAC = "06:00:00:00:00:01"  # a template's own: every pod sets its own (assume)
RECORD, MEMORY = "template.json", "memory"
MAKE_S = 120.0  # a make that does not end within it fails (and is tried on the next create)


@attrs.frozen
class Shape:
    """What a template is made for, as a pod's spec says it."""

    vcpus: int = 1
    memory_mib: int = 512
    disk_mib: int = 0  # the guest's default
    network: bool = False

    @classmethod
    def parse(cls, text: str, *, disk_mib: int = 0) -> Shape:
        """VCPUSxMEMORY_MIB[+net], as --warm-templates and `feosctl template warm` take it."""
        body, _, net = text.partition("+")
        try:
            vcpus, memory = (int(x) for x in body.lower().split("x"))
        except ValueError:
            raise invalid("shape", f"{text!r} is not VCPUSxMEMORY_MIB[+net]") from None
        if net not in ("", "net") or vcpus < 1 or memory < 64:
            raise invalid("shape", f"{text!r} is not VCPUSxMEMORY_MIB[+net]")
        return cls(vcpus, memory, disk_mib, net == "net")


TemplateShape = Shape  # as feos.pods offers it


@attrs.frozen
class Warm:
    """A template to keep warm: a shape and the image its guest holds ("" for none)."""

    shape: Shape
    image: str = ""

    @classmethod
    def parse(cls, text: str, *, disk_mib: int = 0) -> Warm:
        """VCPUSxMEMORY_MIB[+net][=IMAGE], as --warm-templates and `feosctl template warm`
        take it: `1x512+net=registry.example/app:1` a template whose guest pulled that image."""
        shape_text, eq, image = text.partition("=")
        shape = Shape.parse(shape_text, disk_mib=disk_mib)
        if eq:
            check_held(image, shape, "shape")
        return cls(shape, image)


def check_held(image: str, shape: Shape, field: str) -> None:
    """INVALID_ARGUMENT naming the field for an image a template cannot hold."""
    from ._spec import is_image_reference

    if not is_image_reference(image):
        raise invalid(field, f"{image!r} is not an image reference ([registry/]repository[:tag])")
    if not shape.network:
        raise invalid(field, f"a template holding {image} needs +net: its guest pulls the image "
                      "on the pods' network")


TemplateWarm = Warm  # as feos.pods offers it


@attrs.frozen
class TemplateKey:
    guest: str
    vmm: str
    vmm_version: str
    accel: str
    shape: Shape
    drives: int  # the data disk and the volumes: microvm has no hotplug
    base: str  # the layer the template's disk is made on
    image: str = ""  # the image baked into base, if it is a baked layer
    held: str = ""  # the image the template's guest pulled (anonymously) before its snapshot

    @property
    def name(self) -> str:
        fields = attrs.asdict(self)
        if not self.held:
            del fields["held"]  # the names of templates holding no image, as before
        blob = json.dumps(fields, sort_keys=True).encode()
        return str(uuid.UUID(bytes=hashlib.sha256(blob).digest()[:16]))


@attrs.frozen
class Template:
    key: TemplateKey
    layer: str  # the digest of the template's disk, sealed
    memory_digest: str
    memory_bytes: int
    created_ns: int

    @property
    def name(self) -> str:
        return self.key.name

    def record(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def answer(self, directory: Path) -> dict[str, Any]:
        """As the API's TemplateInfo."""
        k = self.key
        return {"name": self.name, "guestVersion": k.guest, "vmm": k.vmm,
                "vmmVersion": k.vmm_version, "accel": k.accel, "vcpus": k.shape.vcpus,
                "memoryMib": k.shape.memory_mib, "diskSizeMib": k.shape.disk_mib,
                "network": k.shape.network, "drives": k.drives, "base": k.base,
                "image": k.image, "heldImage": k.held, "layer": self.layer,
                "memoryDigest": self.memory_digest, "memoryBytes": self.memory_bytes,
                "createdUnixNs": self.created_ns, "path": str(directory)}  # fmt: skip


def from_record(data: dict[str, Any]) -> Template:
    key = dict(data["key"])
    key["shape"] = Shape(**key["shape"])
    return Template(TemplateKey(**key), data["layer"], data["memory_digest"],
                    data["memory_bytes"], data["created_ns"])  # fmt: skip


def _netpod(name: str, vmm: str) -> PodNet:
    """A template's make as the pods' network sees it: a pod of the template's name, in the
    default security group, for the time of its pull."""
    return PodNet(name, "", "", (), (), (), "{}", vmm)


def shape_of(pod: Pod) -> Shape | None:
    """The shape a pod's spec asks for; None for a spec no template serves (volumes: their
    drives would have to be in the template, each of its size)."""
    spec = pod.spec
    if spec.volumes:
        return None
    return Shape(spec.vcpus, spec.memory_mib, spec.disk_size_mib, spec.network is not None)


_VMM_VERSIONS: dict[str, str] = {}


def qemu_version(qemu: str = "qemu-system-x86_64") -> str:
    """QEMU's version (once per process): a snapshot loads only into the QEMU that wrote it."""
    if qemu not in _VMM_VERSIONS:
        try:
            out = subprocess.run([qemu, "--version"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout  # fmt: skip
            _VMM_VERSIONS[qemu] = out.split("\n", 1)[0].removeprefix("QEMU emulator version ")
        except (OSError, subprocess.SubprocessError):
            _VMM_VERSIONS[qemu] = "unknown"
    return _VMM_VERSIONS[qemu]


class Templates:
    def __init__(self, state_dir: Path, vms: MicroVmsPort, diskd: DiskdPort | None, *,
                 on_first_use: bool = True,
                 vmm_version: Callable[[], str] = qemu_version,
                 network: Callable[[], PodNetworkService | None] = lambda: None,
                 ) -> None:  # fmt: skip
        self.root = state_dir / "templates"
        self._vms = vms
        self._diskd = diskd
        self.on_first_use = on_first_use
        self._vmm_version = vmm_version
        self._network = network  # the pods' network, on which a template's guest pulls
        self._have: dict[str, Template] = {}
        self._making: dict[str, trio.Event] = {}
        self._verified: dict[str, tuple[int, int, int]] = {}  # name -> memory's (ino, size, mtime)
        self._nursery: trio.Nursery | None = None
        self._orphans: list[str] = []  # dropped at the start: their keeper disks go later
        self.made = 0  # makes that finished, for the tests and the log

    async def run(self, *, warm: Iterable[Warm] = (),
                  is_pod: Callable[[str], bool] = lambda _id: True,
                  task_status: trio.TaskStatus[Templates] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.to_thread.run_sync(self._load)
            task_status.started(self)
            nursery.start_soon(self._clear_cut_makes, is_pod)
            for one in warm:
                nursery.start_soon(self._warm_quietly, one)
            await trio.sleep_forever()

    # -- what the node has ----------------------------------------------------------------

    def _load(self) -> None:
        from ..vmm import guest_root, installed_guests

        guests = set(installed_guests(guest_root()))
        for d in sorted(self.root.glob("*/")) if self.root.is_dir() else []:
            try:
                template = from_record(json.loads((d / RECORD).read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("template %s dropped: its record is unreadable (%s)", d.name, exc)
                shutil.rmtree(d, ignore_errors=True)
                continue
            if template.key.guest not in guests:
                log.info("template %s dropped: its guest %s is not installed any more",
                         d.name, template.key.guest)  # fmt: skip
                shutil.rmtree(d, ignore_errors=True)  # its keeper disk: removed by _drop_later
                self._orphans.append(d.name)
                continue
            self._have[template.name] = template

    def list(self) -> list[dict[str, Any]]:
        return [t.answer(self.root / t.name) for t in self._have.values()]

    async def _decided(self) -> None:
        """The node's VMM decided (a template's key names it): its probe may still run."""
        decided = getattr(self._vms, "decided", None)
        if decided is not None:
            await decided()

    def key_for(self, shape: Shape, base: str, image: str = "", held: str = "") -> TemplateKey:
        from ..vmm import guest_root, newest_guest

        choice = getattr(self._vms, "choice", None)
        guest, _ = newest_guest(guest_root())
        return TemplateKey(guest=guest, vmm=choice.driver if choice else "qemu",
                           vmm_version=self._vmm_version(),
                           accel=choice.accel if choice else "tcg", shape=shape,
                           drives=1, base=base, image=image, held=held)  # fmt: skip

    # -- the create's side ------------------------------------------------------------------

    async def fitting(self, pod: Pod, base: str, image: str = "",
                      held: str = "") -> Template | None:
        """The template the pod's create restores, verified; None: it boots cold (a make may
        have been started for the next create). `held`: the image of the pod's one container
        on a disk that holds none: a template holding it is taken first, one holding none
        after (a template holding an image is made only by a warm, never on first use)."""
        shape = shape_of(pod)
        if shape is None or self._nursery is None or not (self._have or self.on_first_use):
            return None
        await self._decided()
        try:
            key = await trio.to_thread.run_sync(self.key_for, shape, base, image)
        except FeosError as exc:
            log.info("pod %s: no template (%s)", pod.id, exc.message)
            return None
        if key.vmm != "qemu":
            return None
        holding = attrs.evolve(key, held=held) if held and shape.network else None
        if holding is not None and holding.name in self._have:
            found = await self._sound(holding, pod)
            if found is not None:
                return found
        if key.name in self._have:
            return await self._sound(key, pod)
        if self.on_first_use and key.name not in self._making:
            self._nursery.start_soon(self._make_quietly, key)
        return None

    async def _sound(self, key: TemplateKey, pod: Pod) -> Template | None:
        """The node's template of the key, verified; None for a damaged one, which is dropped
        and made again (whatever the option)."""
        assert self._nursery is not None
        template = self._have[key.name]
        why = await self._damage(template)
        if not why:
            return template
        log.warning("template %s is damaged (%s): dropped and made again; pod %s does not "
                    "restore it", template.name, why, pod.id)  # fmt: skip
        await self.remove(template.name)
        self._nursery.start_soon(self._make_quietly, key)
        return None

    async def _damage(self, template: Template) -> str:
        """Why the template cannot be restored, or ""."""
        memory = self.root / template.name / MEMORY
        try:
            st = memory.stat()
        except FileNotFoundError:
            return "its snapshot is missing"
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._verified.get(template.name) != seen:
            digest = await trio.to_thread.run_sync(sha256_file, memory)
            if digest != template.memory_digest:
                return f"its snapshot's digest is {digest}, not {template.memory_digest}"
            self._verified[template.name] = seen
        assert self._diskd is not None
        try:
            disk = (await self._diskd.call("getDisk", id=template.name))["disk"]
        except FeosError as exc:
            if exc.code is Code.NOT_FOUND:
                return "its layer is missing"
            raise
        if disk.get("base") != template.layer:
            return f"its layer is {disk.get('base')}, not {template.layer}"
        return ""

    def memory(self, template: Template) -> Path:
        return self.root / template.name / MEMORY

    # -- making, warming, removing -----------------------------------------------------------

    async def warm(self, shape: Shape, base: str, image: str = "") -> Template:
        """The template of the shape on `base`, its guest holding `image` if one is named
        (made now unless the node has it)."""
        if image:
            check_held(image, shape, "image")
        await self._decided()
        key = await trio.to_thread.run_sync(self.key_for, shape, base, "", image)
        if key.vmm != "qemu":
            raise FeosError(Code.FAILED_PRECONDITION, f"the node's VMM is {key.vmm}: templates "
                            "are made for QEMU only")
        have = self._have.get(key.name)
        if have is not None and not await self._damage(have):
            return have
        if have is not None:
            await self.remove(have.name)
        return await self.make(key)

    async def _warm_quietly(self, one: Warm) -> None:
        try:
            assert self._diskd is not None
            await self.warm(one.shape, await self.blank(), one.image)
        except FeosError as exc:
            log.warning("the template of %r was not made: %s", one, exc.message)

    async def blank(self) -> str:
        """The newest guest's blank data volume's layer (imported into diskd once)."""
        from ..vmm import guest_root, newest_guest

        if self._diskd is None:
            raise FeosError(Code.FAILED_PRECONDITION, "templates need diskd")
        _, gdir = newest_guest(guest_root())
        layer = await self._diskd.call("importLayer", path=str(gdir / "data.img.zst"),
                                       guest=gdir.name)  # fmt: skip
        return str(layer["layer"]["digest"])

    async def _make_quietly(self, key: TemplateKey) -> None:
        try:
            await self.make(key)
        except FeosError as exc:
            log.warning("template %s was not made: %s", key.name, exc.message)

    async def make(self, key: TemplateKey) -> Template:
        """The one make of the key (a second caller waits for the first's end)."""
        name = key.name
        while name in self._making:
            await self._making[name].wait()
            if name in self._have:
                return self._have[name]
        done = self._making[name] = trio.Event()
        try:
            with trio.fail_after(MAKE_S):
                template = await self._make(key)
        except trio.TooSlowError:
            raise FeosError(Code.DEADLINE_EXCEEDED,
                            f"template {name} was not made within {MAKE_S:g}s") from None
        finally:
            del self._making[name]
            done.set()
        return template

    async def _make(self, key: TemplateKey) -> Template:
        from feos.net import delete_tap, make_bare_tap, tap_name

        from ..vmm import VmSpec

        assert self._diskd is not None
        name, began = key.name, time.monotonic()
        tap = tap_name(name) if key.shape.network else None
        network = self._network() if key.held else None
        if key.held and network is None:
            raise FeosError(Code.FAILED_PRECONDITION, f"template {name} cannot hold {key.held}: "
                            "the node has no pods' network to pull it on")
        netpod = _netpod(name, key.vmm) if network is not None else None
        await self._clear(name, tap)
        try:
            await self._diskd.call("createDisk", id=name, kind="pod",
                                   sizeBytes=key.shape.disk_mib << 20, base=key.base)
            disk = (await self._diskd.call("startDisk", id=name, vmm=key.vmm, ownerUid=0))["disk"]
            if network is not None and netpod is not None:
                netpod = await network.allocate(netpod)
                await network.prepare(netpod)  # its TAP, in the table as a pod's for the pull
            elif tap is not None:
                await trio.to_thread.run_sync(make_bare_tap, tap)
            spec = VmSpec(vcpus=key.shape.vcpus, memory_mib=key.shape.memory_mib,
                          data_disk=disk["path"], data_format=disk["format"],
                          backing=tuple(disk.get("chain", ())), tap=tap,
                          mac=TEMPLATE_MAC if tap else None)  # fmt: skip
            await self._vms.create(name, spec)
            await self._vms.start(name, wait_attach=True)
            guest = await self._vms.guest(name, within=30.0)  # greeted: the agent is all there
            if network is not None and netpod is not None:
                await self._hold(guest, key.held, network, netpod)
            await self._vms.suspend(name)
            await self._diskd.call("stopDisk", id=name)
            layer = (await self._diskd.call("bake", id=name, image=key.image or "template"))
            digest = str(layer["layer"]["digest"])
            await self._diskd.call("deleteDisk", id=name)
            await self._diskd.call("createDisk", id=name, kind="pod",
                                   sizeBytes=key.shape.disk_mib << 20, base=digest)
            template = await trio.to_thread.run_sync(
                self._keep, key, digest, self._vms.snapshot(name))
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                if network is not None and netpod is not None:
                    await network.remove(netpod)
                await self._clear(name, tap, keep_record=False)
            raise
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await self._vms.delete(name)
            if network is not None and netpod is not None:
                await network.remove(netpod)  # its TAP and its addresses
            elif tap is not None:
                await delete_tap(tap)
        self._have[name] = template
        self.made += 1
        log.info("template %s made in %.1f s (%s, %d MiB of memory)", name,
                 time.monotonic() - began, key.shape, template.memory_bytes >> 20)  # fmt: skip
        return template

    async def _hold(self, guest: Any, image: str, network: PodNetworkService,
                    netpod: PodNet) -> None:
        """The template's guest pulls the image without a token on the pods' network, then
        zeroes its free memory (the pull's page cache, dropped, would be in the snapshot).
        FAILED_PRECONDITION naming the image for one whose registry wants a token."""
        from ._ports import NetworkConfig

        config = network.guest_network(netpod)
        await guest.configure_network(NetworkConfig(
            ipv6=config.ipv6, ipv4=config.ipv4, resolvers=(config.resolver,), mtu=config.mtu))
        try:
            await guest.pull_image(image, "")
        except FeosError as exc:
            if exc.code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                raise FeosError(Code.FAILED_PRECONDITION, f"image {image} needs a pull token: "
                                "a template holds only an image pulled anonymously (no pod may "
                                f"get an image through another's token): {exc.message}") from None
            raise FeosError(exc.code, f"the template's pull of {image}: {exc.message}") from None
        before, after = await guest.prepare_suspend(True)  # zero_free (the handle: no keywords)
        log.info("template of %s: its free memory zeroed (%d MiB free before, %d after)",
                 image, before >> 20, after >> 20)  # fmt: skip

    def _keep(self, key: TemplateKey, layer: str, snapshot: Path) -> Template:
        d = self.root / key.name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        memory = d / MEMORY
        os.replace(snapshot, memory)
        template = Template(key, layer, sha256_file(memory), memory.stat().st_size,
                            time.time_ns())  # fmt: skip
        tmp = d / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(template.record(), indent=1))
        with open(tmp) as f:
            os.fsync(f.fileno())
        tmp.replace(d / RECORD)
        return template

    async def _clear(self, name: str, tap: str | None, *, keep_record: bool = False) -> None:
        """What a make cut off (a crash of feosd, a failure) left: its microVM, disk, TAP."""
        from feos.net import delete_tap

        await self._vms.delete(name)
        if self._diskd is not None:
            try:
                await self._diskd.call("deleteDisk", id=name)
            except FeosError as exc:
                if exc.code is not Code.NOT_FOUND:
                    raise
        if tap is not None:
            await delete_tap(tap)
        if not keep_record:
            await trio.to_thread.run_sync(
                lambda: shutil.rmtree(self.root / name, ignore_errors=True))

    async def remove(self, name: str) -> None:
        """The template gone: its record, memory and keeper disk; its layer stays in diskd
        while the disks of pods made from it stand on it. NOT_FOUND for one the node lacks."""
        if name not in self._have:
            raise FeosError(Code.NOT_FOUND, f"template {name} does not exist")
        if name in self._making:
            raise FeosError(Code.FAILED_PRECONDITION, f"template {name} is being made")
        del self._have[name]
        self._verified.pop(name, None)
        await self._clear(name, None)
        log.info("template %s removed", name)

    async def _clear_cut_makes(self, is_pod: Callable[[str], bool]) -> None:
        """At the start: the microVMs of makes a restart cut off (every microVM is a pod's or
        a make's), and the keeper disks of templates dropped (their guest is gone)."""
        from feos.net import delete_tap, tap_name

        for info in self._vms.list():
            if is_pod(info.id) or info.id in self._making:
                continue
            log.info("microVM %s: a template's make cut off; removed", info.id)
            if info.id in self._have:  # cut after its template was kept: only the VM goes
                await self._vms.delete(info.id)
                await delete_tap(tap_name(info.id))
            else:
                await self._clear(info.id, tap_name(info.id), keep_record=True)
        for name in self._orphans:
            await self._clear(name, None)
        self._orphans.clear()

