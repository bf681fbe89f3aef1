"""vms.db: the microVM records, in SQLite, by the pod's ID.

The key is the pod's ID as the spec keeps it: a UUID as its 16 bytes (a BLOB), a short ID (11
characters of lowercase Crockford base32, a letter first) as TEXT; SQLite orders and compares the
two kinds apart, so neither can shadow the other. The encoding is pure (`encode_id`, `to_row`,
`from_row`); `Records` is the blocking store, which the service calls on a worker thread, one
write at a time, after the call that made a change returned. Reads come from the service's memory.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import attrs

from feos.errors import invalid

from ._driver import VmSpec, VmState

_SHORT_ID = re.compile(r"[a-hjkmnp-tv-z][0-9a-hjkmnp-tv-z]{10}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS vms (
    id BLOB PRIMARY KEY,     -- 16 bytes for a UUID, TEXT for a short ID
    driver TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    guest_version TEXT NOT NULL,
    accel TEXT NOT NULL,
    uid INTEGER,
    spec TEXT NOT NULL       -- VmSpec as JSON
)
"""


def check_id(vm_id: str) -> str:
    """The pod's ID if it is one (short ID or lowercase UUID), else INVALID_ARGUMENT."""
    if _SHORT_ID.fullmatch(vm_id) or _UUID.fullmatch(vm_id):
        return vm_id
    raise invalid("id", f"{vm_id!r} is neither a pod ID nor a UUID")


def encode_id(vm_id: str) -> bytes | str:
    check_id(vm_id)
    return uuid.UUID(vm_id).bytes if _UUID.fullmatch(vm_id) else vm_id


def decode_id(key: bytes | str) -> str:
    if isinstance(key, bytes):
        return str(uuid.UUID(bytes=key))
    return check_id(key)


@attrs.frozen
class VmRecord:
    id: str
    driver: str
    state: VmState
    reason: str
    guest_version: str
    accel: str
    spec: VmSpec
    uid: int | None = None


def spec_to_json(spec: VmSpec) -> str:
    return json.dumps(attrs.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> VmSpec:
    raw: dict[str, Any] = json.loads(text)
    fields = {f.name for f in attrs.fields(VmSpec)}
    raw = {k: v for k, v in raw.items() if k in fields}  # a newer field a rollback does not know
    for key in ("volumes", "kernel_extra", "volume_formats", "backing"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return VmSpec(**raw)


def to_row(r: VmRecord) -> tuple[Any, ...]:
    return (encode_id(r.id), r.driver, r.state.value, r.reason, r.guest_version, r.accel, r.uid,
            spec_to_json(r.spec))  # fmt: skip


def from_row(row: tuple[Any, ...]) -> VmRecord:
    key, driver, state, reason, version, accel, uid, spec = row
    return VmRecord(decode_id(key), driver, VmState(state), reason, version, accel,
                    spec_from_json(spec), uid)  # fmt: skip


class Records:
    """The blocking store. Every method may block on fsync: call it from a worker thread."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a kept record survives a power cut
            self._db.execute(_SCHEMA)

    def put(self, record: VmRecord) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO vms VALUES (?,?,?,?,?,?,?,?)", to_row(record))

    def remove(self, vm_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM vms WHERE id = ?", (encode_id(vm_id),))

    def all(self) -> list[VmRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM vms").fetchall()
        return [from_row(tuple(row)) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
