"""The demo image: busybox-static's httpd, as an OCI image layout built here, pushed with skopeo.

Nothing is downloaded: the one layer holds Debian's /bin/busybox (the busybox-static package) and
its applets as symlinks, an /etc/passwd and a page. The container's command writes a page that
names the pod ($POD, which the quickstart sets to the pod's ID; else the hostname,
which is the container's name) and runs `httpd -f` on DEMO_PORT. The layout is
written to `<quickstart>/image` (oci-layout, index.json, blobs/sha256/...) with fixed timestamps,
so the same busybox gives the same digest on every run; skopeo copies it to the local registry
(`skopeo copy oci:DIR:TAG docker://HOST/REPO:TAG`) only when the registry lacks that digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

BUSYBOX = Path("/bin/busybox")
DEMO_PORT = 8080
REPOSITORY, TAG = "feos/demo", "1"
APPLETS = ("sh", "echo", "cat", "mkdir", "hostname", "httpd", "wget", "ls", "ps", "sleep")
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
SERVE = ("busybox mkdir -p /www && echo \"hello from pod ${POD:-$(busybox hostname)}, served by"
         f" busybox httpd\" > /www/index.html && exec busybox httpd -f -p {DEMO_PORT} -h /www")


def _tar(files: dict[str, bytes | str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("bin", "etc", "www", "tmp"):
            tar.addfile(_info(name, tarfile.DIRTYPE, 0o755))
        for name, data in files.items():
            if isinstance(data, str):  # a symlink's target
                tar.addfile(_info(name, tarfile.SYMTYPE, 0o777, linkname=data))
            else:
                tar.addfile(_info(name, tarfile.REGTYPE, 0o755, size=len(data)), io.BytesIO(data))
    return out.getvalue()


def _info(name: str, kind: bytes, mode: int, *, size: int = 0,
          linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, size, linkname, 0
    return info


def layer() -> bytes:
    files: dict[str, bytes | str] = {"bin/busybox": BUSYBOX.read_bytes()}
    files.update({f"bin/{a}": "busybox" for a in APPLETS})
    files["etc/passwd"] = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
    files["etc/group"] = b"root:x:0:\nnogroup:x:65534:\n"
    return _tar(files)


def image_config(layer_digest: str) -> dict[str, Any]:
    return oci_config({"Cmd": ["/bin/sh", "-c", SERVE], "WorkingDir": "/www",
                       "ExposedPorts": {f"{DEMO_PORT}/tcp": {}}}, layer_digest)


def oci_config(config: dict[str, Any], layer_digest: str) -> dict[str, Any]:
    """An amd64 image's config of one uncompressed layer (its diff_id is its digest)."""
    return {"architecture": "amd64", "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def blob_file(layout: Path, path: Path) -> dict[str, Any]:
    """A file (a large layer, written beside the layout) moved into the layout's blobs."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    digest = "sha256:" + sha.hexdigest()
    size = path.stat().st_size
    blob = layout / "blobs" / "sha256" / sha.hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    path.replace(blob)
    return {"digest": digest, "size": size}


def write_image(layout: Path, layer: dict[str, Any], config: dict[str, Any], tag: str) -> str:
    """The OCI layout's index naming one image of `layer` (a blob's descriptor) and `config`
    (an image config, oci_config's); the manifest's digest."""
    lay = layer | {"mediaType": "application/vnd.oci.image.layer.v1.tar"}
    cfg = _blob(layout, json.dumps(config, sort_keys=True).encode()) | {
        "mediaType": "application/vnd.oci.image.config.v1+json"}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": _MANIFEST, "config": cfg,
                           "layers": [lay]}, sort_keys=True).encode()
    man = _blob(layout, manifest) | {"mediaType": _MANIFEST,
                                    "annotations": {"org.opencontainers.image.ref.name": tag}}
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [man]}))
    return str(man["digest"])


def write_layout(layout: Path) -> str:
    """Write (or find written) the OCI layout of the demo image; its manifest's digest."""
    lay = _blob(layout, layer())
    return write_image(layout, lay, image_config(lay["digest"]), TAG)


def pushed_digest(registry: str, repository: str = REPOSITORY, tag: str = TAG) -> str | None:
    """The digest the registry holds for the tag (skopeo inspect), or None."""
    done = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}",
                           f"docker://{registry}/{repository}:{tag}"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None if done.returncode == 0 else None


def push(layout: Path, registry: str, repository: str = REPOSITORY, tag: str = TAG,
         prefix: tuple[str, ...] = ()) -> None:
    """skopeo copy of the layout's tag to the registry (`prefix`: as `ip netns exec NS`)."""
    subprocess.run([*prefix, "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                    "--preserve-digests", f"oci:{layout}:{tag}",
                    f"docker://{registry}/{repository}:{tag}"],
                   check=True, capture_output=True, text=True, timeout=600)


def reference(registry: str) -> str:
    return f"{registry}/{REPOSITORY}:{TAG}"
