# The fields of schema.capnp's CodeGeneratorRequest that feos/guest/_schema.py reads, at the same
# ordinals (so the same places): parsed in the guest in place of guest.capnp, it is the one parse
# the agent's start pays for (see _schema.load_compiled).
@0xafc697094d394cef;

struct CodeGeneratorRequest {
  nodes @0 :List(Node);
  requestedFiles @1 :List(RequestedFile);
}

# Read as a schema.Node by SchemaLoader.load_dynamic: its fields are not needed here.
struct Node {}

struct RequestedFile {
  id @0 :UInt64;
  filename @1 :Text;
}
