"""The node's side of schema/guest.capnp on pycapnp (feos.guest._client), loaded once.

The guest's agent does not use this module: it speaks Cap'n Proto through feos.guest._wire and
_rpc, and its `guest` namespace is feos.guest._proto's. The Status <-> FeosError conversions both
ends use are _proto's, re-exported here for the node's code.
"""

from __future__ import annotations

import os
from typing import Any

import capnp  # type: ignore[import-untyped]

from ._proto import code_name as code_name
from ._proto import fill_status as fill_status
from ._proto import raise_status as raise_status

# Every loader of schema/ must name files by the same absolute path and import path: pycapnp
# aborts the process on a file it meets twice under two names (Duplicate ID).
# feos/guest/_schema.py -> the repo's root, which holds feos/ and schema/
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_DIR = os.path.join(_ROOT, "schema")

guest: Any = capnp.load(os.path.join(SCHEMA_DIR, "guest.capnp"), imports=[SCHEMA_DIR])
