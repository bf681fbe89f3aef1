"""schema/guest.capnp, loaded once, and the Status <-> FeosError conversions both ends use.

In the guest image the schema comes compiled (packaging/guest/build.py: `capnp compile -o-`, a
CodeGeneratorRequest, in compiled/ beside schema/): pycapnp's SchemaLoader takes its nodes as
they are, which spares the guest's start most of the C++ parser's work under TCG (0.14 s for
guest.capnp, run cold). The loader needs the nodes as struct readers, and a reader needs a
parsed schema: compiled/request.capnp, a few lines, gives one. Elsewhere (the node, the tests)
the schema files are parsed.
"""

from __future__ import annotations

import os

import capnp  # type: ignore[import-untyped]

from feos.errors import Code, FeosError

from ._proto import code_name as code_name
from ._proto import fill_status as fill_status
from ._proto import raise_status as raise_status

TYPE_CHECKING = False  # mypy takes it as true; typing itself costs the guest's start time
if TYPE_CHECKING:
    from typing import Any

# Every loader of schema/ must name files by the same absolute path and import path: pycapnp
# aborts the process on a file it meets twice under two names (Duplicate ID).
# feos/guest/_schema.py -> the root that holds feos/ and schema/ (the repo, or /usr/lib/feos-guest)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_DIR = os.path.join(_ROOT, "schema")
COMPILED_DIR = os.path.join(_ROOT, "compiled")  # the image's; the repo has none


def load(name: str, compiled_dir: str = COMPILED_DIR) -> Any:
    """schema/<name> as capnp.load gives it: from compiled/<name>.bin if there is one."""
    try:
        with open(os.path.join(compiled_dir, f"{name}.bin"), "rb") as f:
            request = f.read()
    except FileNotFoundError:
        return capnp.load(os.path.join(SCHEMA_DIR, name), imports=[SCHEMA_DIR])
    return load_compiled(request, name, os.path.join(compiled_dir, "request.capnp"))


def load_compiled(request: bytes, name: str, request_capnp: str) -> Any:
    """The file <name> of a CodeGeneratorRequest, as a module like capnp.load's."""
    shape = capnp.load(request_capnp)  # the few fields of a CodeGeneratorRequest read here
    loader = capnp.SchemaLoader()
    with shape.CodeGeneratorRequest.from_bytes(request) as req:
        for node in req.nodes:
            loader.load_dynamic(node)  # it reads the node as a schema.Node, whatever the reader
        ids = [f.id for f in req.requestedFiles if os.path.basename(f.filename) == name]
    if len(ids) != 1:
        raise FeosError(Code.INTERNAL, f"the compiled schema has no single file {name}")
    module = _module(loader, loader.get(ids[0]), name)
    module._loader = loader  # the schemas live as long as it does
    return module


def _module(loader: Any, schema: Any, name: str) -> Any:
    """What pycapnp's SchemaParser.load makes of a file node, with the loader's schemas."""
    lib = capnp.lib.capnp
    module = lib._ModuleType(name)
    _fill(lib, loader, schema, module)
    return module


def _fill(lib: Any, loader: Any, parent: Any, module: Any) -> None:
    module._nodeSchema = parent
    module._nodeProto = parent.get_proto()
    for nested in module._nodeProto.nestedNodes:
        schema = loader.get(nested.id)
        proto = schema.get_proto()
        local = lib._ModuleType(nested.name)
        if proto.isStruct:
            local = lib._StructModule(schema.as_struct(), nested.name)
            local.Reader = type("Reader", (lib._DynamicStructReader,), _abstract(local.schema))
            local.Builder = type("Builder", (lib._DynamicStructBuilder,), _abstract(local.schema))
            module.__dict__[nested.name] = local
        elif proto.isConst:
            module.__dict__[nested.name] = schema.as_const_value()
        elif proto.isInterface:
            local = lib._InterfaceModule(schema.as_interface(), nested.name)
            module.__dict__[nested.name] = local
        elif proto.isEnum:
            local = lib._EnumModule(schema.as_enum(), nested.name)
            module.__dict__[nested.name] = local
        _fill(lib, loader, schema, local)


def _abstract(schema: Any) -> dict[str, Any]:
    """The body of pycapnp's Reader and Builder classes: bases for isinstance, never made."""

    def __new__(cls: type) -> None:
        raise TypeError("This is an abstract base class")

    meta = capnp.lib.capnp._StructABCMeta  # as pycapnp's class bodies name it (unused in 3.x)
    return {"__metaclass__": meta, "__slots__": [], "_schema": schema, "__new__": __new__}


guest: Any = load("guest.capnp")
