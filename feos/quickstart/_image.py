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
    return {"architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/sh", "-c", SERVE], "WorkingDir": "/www",
                       "ExposedPorts": {f"{DEMO_PORT}/tcp": {}}},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest.removeprefix("sha256:")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def write_layout(layout: Path) -> str:
    """Write (or find written) the OCI layout of the demo image; its manifest's digest."""
    data = layer()
    lay = _blob(layout, data) | {"mediaType": "application/vnd.oci.image.layer.v1.tar"}
    config = json.dumps(image_config(lay["digest"]), sort_keys=True).encode()
    cfg = _blob(layout, config) | {"mediaType": "application/vnd.oci.image.config.v1+json"}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": _MANIFEST, "config": cfg,
                           "layers": [lay]}, sort_keys=True).encode()
    man = _blob(layout, manifest) | {"mediaType": _MANIFEST,
                                    "annotations": {"org.opencontainers.image.ref.name": TAG}}
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [man]}))
    return str(man["digest"])


def pushed_digest(registry: str) -> str | None:
    """The digest the registry holds for the demo's tag (skopeo inspect), or None."""
    done = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}",
                           f"docker://{registry}/{REPOSITORY}:{TAG}"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None if done.returncode == 0 else None


def push(layout: Path, registry: str) -> None:
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                    "--preserve-digests", f"oci:{layout}:{TAG}",
                    f"docker://{registry}/{REPOSITORY}:{TAG}"],
                   check=True, capture_output=True, text=True, timeout=300)


def reference(registry: str) -> str:
    return f"{registry}/{REPOSITORY}:{TAG}"
