"""A file's content digest, as the layers, checkpoints and templates name their files."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str) -> str:
    """"sha256:<hex>" of the file's bytes, read a MiB at a time (blocking)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
