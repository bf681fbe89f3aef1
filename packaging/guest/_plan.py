"""The pure part of the guest image build: what goes in, what the version is, in which order.

No I/O here (but for reading the files whose hashes make the version, which the caller lists):
the builder (build.py) runs the programs, this module decides. It uses the standard library only,
so that the build runs under any python3 of the build machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping

SUITE = "bookworm"

# Debian minbase plus what the agent runs: crun for the containers, e2fsprogs to format volumes,
# iproute2 for the network it is pushed, util-linux (mount, fstrim), busybox-static for a shell
# when debugging. The agent is pure Python (its Cap'n Proto is its own: feos/guest/_wire, _rpc).
ROOT_PACKAGES = (
    "python3",
    "crun",
    "e2fsprogs",
    "iproute2",
    "util-linux",
    "busybox-static",
)

KERNEL_META = "linux-image-amd64"

# The modules the initramfs loads, in this order of wants; their dependencies come first
# (modprobe --show-depends). crc32c-intel fails without SSE4.2 and crc32c_generic stands in.
INITRAMFS_MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_rng",
    "virtio_net",
    "virtio_balloon",
    "vmw_vsock_virtio_transport",
    "erofs",
    "ext4",
    "overlay",  # the containers' rootfs over the image store's layers
)

# Module directories the root image leaves out: hardware a microVM never has.
ROOT_MODULES_SKIP = (
    "kernel/sound",
    "kernel/drivers/gpu",
    "kernel/drivers/media",
    "kernel/drivers/net/wireless",
    "kernel/drivers/net/ethernet",
    "kernel/drivers/infiniband",
    "kernel/drivers/staging",
    "kernel/drivers/scsi",
    "kernel/drivers/usb",
    "kernel/drivers/bluetooth",
    "kernel/drivers/hid",
    "kernel/drivers/input",
    "kernel/drivers/iio",
    "kernel/drivers/isdn",
    "kernel/drivers/mtd",
    "kernel/drivers/video",
    "kernel/drivers/ata",
    "kernel/drivers/nfc",
    "kernel/drivers/thunderbolt",
    "kernel/drivers/platform",
    "kernel/drivers/hwmon",
    "kernel/drivers/edac",
    "kernel/drivers/misc",
    "kernel/drivers/mmc",
    "kernel/drivers/pinctrl",
    "kernel/drivers/gpio",
    "kernel/drivers/i2c",
    "kernel/drivers/spi",
    "kernel/drivers/leds",
    "kernel/drivers/firewire",
    "kernel/drivers/target",
    "kernel/net/wireless",
    "kernel/net/mac80211",
    "kernel/net/bluetooth",
)

# Trimmed from the root: nothing in the guest reads them, and they cost image size and build time.
ROOT_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)


def mirror_from_sources(text: str, suite: str = SUITE) -> str | None:
    """The URI of the first deb822 stanza (debian.sources) that serves `suite`."""
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if suite in fields.get("suites", "").split() and fields.get("uris"):
            return fields["uris"].split()[0]
    return None


def mirror_from_list(text: str, suite: str = SUITE) -> str | None:
    """The URI of the first one-line `deb` entry (sources.list) that serves `suite`."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 3 and words[0] == "deb":
            rest = words[1:]
            if rest[0].startswith("["):  # options: [arch=amd64 signed-by=...]
                while rest and not rest[0].endswith("]"):
                    rest = rest[1:]
                rest = rest[1:]
            if len(rest) >= 2 and rest[1] == suite:
                return rest[0]
    return None


def candidate_version(policy: str) -> str | None:
    """The Candidate of `apt-cache policy PKG`, or None when there is none."""
    m = re.search(r"^\s*Candidate:\s*(\S+)", policy, re.MULTILINE)
    if m is None or m.group(1) == "(none)":
        return None
    return m.group(1)


def candidate_versions(policy: str) -> dict[str, str | None]:
    """Each package's Candidate from one `apt-cache policy P1 P2 ...` (a block per package)."""
    out: dict[str, str | None] = {}
    for block in re.split(r"^(?=\S+:\s*$)", policy, flags=re.MULTILINE):
        head, _, rest = block.partition("\n")
        if head.rstrip().endswith(":") and not head[:1].isspace():
            out[head.rstrip()[:-1]] = candidate_version(rest)
    return out


def kernel_package(depends: str) -> str:
    """The linux-image-<abi>-amd64 that `apt-cache depends linux-image-amd64` names."""
    m = re.search(r"Depends:\s*(linux-image-\d[\w.+-]*-amd64)\b", depends)
    if m is None:
        raise ValueError(f"no kernel package in: {depends!r}")
    return m.group(1)


def module_load_order(show_depends: Iterable[str]) -> list[str]:
    """Module paths in load order, each once, from `modprobe --show-depends` outputs in order.

    Lines are `insmod /path/to/mod.ko [params]`; `builtin name` lines need nothing loaded.
    """
    seen: dict[str, None] = {}
    for text in show_depends:
        for line in text.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "insmod":
                seen.setdefault(words[1], None)
    return list(seen)


_SIG_MAGIC = b"~Module signature appended~\n"


def strip_module_signature(ko: bytes) -> bytes:
    """A module without its appended signature (struct module_signature: its last 4 bytes, big
    endian, are the signature's length), or the module as it is if it has none.

    Checking a signature hashes the whole module with sha256, which costs about 0.2-0.35 s of
    the boot's module loads under TCG. Debian's kernel does not enforce signatures
    (CONFIG_MODULE_SIG_FORCE is off, lockdown only under EFI secure boot): an unsigned module
    loads and taints the kernel with E, which is all it changes.
    """
    if not ko.endswith(_SIG_MAGIC) or len(ko) < len(_SIG_MAGIC) + 12:
        return ko
    info_end = len(ko) - len(_SIG_MAGIC)
    sig_len = int.from_bytes(ko[info_end - 4 : info_end], "big")
    start = info_end - 12 - sig_len
    return ko[:start] if start > 0 else ko


def input_version(inputs: Mapping[str, object]) -> str:
    """The version: 12 hex digits of a sha256 over the build's inputs, in a canonical JSON."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def tree_key(*parts: object) -> str:
    """A cache key for an intermediate product (the debootstrap tree) from what made it."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def newest_version(manifests: Mapping[str, Mapping[str, object]]) -> str | None:
    """The newest installed version: the greatest by (manifest "built", version)."""
    best: tuple[str, str] | None = None
    for version, manifest in manifests.items():
        key = (str(manifest.get("built", "")), version)
        if best is None or key > best:
            best = key
    return None if best is None else best[1]


KEEP_NEWEST = 3  # versions a prune always keeps, newest first
KEEP_HOURS = 24.0  # and every version built more recently than this


def built_at(manifest: Mapping[str, object]) -> float | None:
    """The manifest's "built" as seconds since the epoch; None if it has none or a bad one."""
    import datetime

    try:
        when = datetime.datetime.fromisoformat(str(manifest["built"]))
    except (KeyError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def versions_to_prune(
    manifests: Mapping[str, Mapping[str, object]],
    in_use: Iterable[str],
    now: float,
    keep_newest: int = KEEP_NEWEST,
    keep_hours: float = KEEP_HOURS,
) -> list[str]:
    """The installed versions a prune removes, oldest first.

    Kept: the keep_newest newest by (built, version), every version built less than keep_hours
    ago (or whose build time is unknown or in the future: nothing says it is old), and every
    version in use. The rest go.
    """
    used = set(in_use)
    order = sorted(manifests, key=lambda v: (str(manifests[v].get("built", "")), v), reverse=True)
    out = []
    for version in order[max(keep_newest, 0) :]:
        when = built_at(manifests[version])
        if version in used or when is None or now - when < keep_hours * 3600:
            continue
        out.append(version)
    return out[::-1]
