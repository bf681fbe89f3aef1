@0xa3c1f27e9b6d4e05;
# Pod templates (docs/templates.md): snapshots of guests that booted, which a create restores
# instead of booting. Reached from the Feos bootstrap's `templates`.

using Common = import "common.capnp";

struct TemplateInfo {
  name @0 :Text;            # a UUID of the key: the same key, the same name on every node
  guestVersion @1 :Text;
  vmm @2 :Text;             # qemu (the one VMM templates are made for)
  vmmVersion @3 :Text;
  accel @4 :Text;           # tcg or kvm
  vcpus @5 :UInt32;
  memoryMib @6 :UInt32;
  diskSizeMib @7 :UInt32;   # the data disk's size, which the snapshot's guest has seen
  network @8 :Bool;         # a network device in the snapshot
  drives @9 :UInt32;        # drives in the snapshot (the data disk: pods with volumes boot cold)
  base @10 :Text;           # the layer its disk was made on (a guest's blank data or a baked image)
  image @11 :Text;          # the image baked into base; "" for a guest's blank data
  layer @12 :Text;          # its disk, sealed: new pods' disks stand on it
  memoryDigest @13 :Text;   # sha256 of its snapshot's memory
  memoryBytes @14 :UInt64;
  createdUnixNs @15 :Int64;
  path @16 :Text;           # its directory on the node
  heldImage @17 :Text;      # the image its guest pulled before the snapshot (anonymously); ""
                            # for none. A create of it checks the tag's digest with its own token
}

interface TemplateService {
  listTemplates @0 () -> (status :Common.Status, templates :List(TemplateInfo));
  warmTemplate @1 (vcpus :UInt32, memoryMib :UInt32, diskSizeMib :UInt32, network :Bool,
                   image :Text) -> (status :Common.Status, template :TemplateInfo);
  # The template of that shape on the newest guest's blank data, made now unless the node has
  # it (whole, its digests matching). 0: the pod spec's default. image: the template's guest
  # pulls it (anonymously, on the pods' network) before the snapshot; "" for none.
  # FAILED_PRECONDITION where the node's VMM is not QEMU or there is no diskd, for an image
  # without a network, and for an image whose registry wants a pull token (naming it).
  removeTemplate @2 (templateName :Text) -> (status :Common.Status);
  # NOT_FOUND for a template the node lacks; FAILED_PRECONDITION while it is being made. The
  # pods made from it run on.
}
