@0x99b913818c00a48d;
# The microVM layer's internal interface (feos.vmm.MicroVms, docs/vmm.md): what the pod service
# asks of the microVMs. Not served to clients of the API; kept so that the layer can run in a
# process of its own and so that its values have one wire form.

using Common = import "common.capnp";

enum VmState {
  created @0;      # prepared, never booted (or ready to boot again)
  running @1;
  stopped @2;      # the guest shut down or rebooted: the VMM exited 0
  crashed @3;      # the VMM died, or the guest never attached
  suspended @4;    # a snapshot in the microVM's directory, no process
  busy @5;         # a late snapshot: the VMM still writes it; suspend and shutdown refused
}

struct VmSpec {
  vcpus @0 :UInt8;
  memoryMib @1 :UInt32;
  dataDisk @2 :Text;             # a file the VMM opens as drive "data"; empty: none
  volumes @3 :List(Text);        # drives "vol1", "vol2", ... in order
  tap @4 :Text;                  # the pod's TAP device; empty: no network
  mac @5 :Text;
  metadata @6 :Text;             # the pod's metadata object, JSON
}

struct VmInfo {
  id @0 :Text;                   # the pod's ID (short ID or UUID)
  state @1 :VmState;
  reason @2 :Text;               # why it is stopped or crashed, for people
  driver @3 :Text;               # "qemu" or "firecracker"
  accel @4 :Text;                # "kvm" or "tcg"
  guestVersion @5 :Text;         # the installed guest it was created with
  vcpus @6 :UInt8;
  memoryMib @7 :UInt32;
  attached @8 :Bool;             # a guest session is up
}

struct VmEvent {
  id @0 :Text;
  union {
    stopped @1 :Text;            # the reason
    crashed @2 :Text;            # the reason
    suspended @3 :Void;
    guestAttached @4 :Text;      # the guest's boot ID
  }
}

interface VmEvents {
  event @0 (event :VmEvent) -> ();
}

interface MicroVmService {
  create @0 (id :Text, spec :VmSpec) -> (status :Common.Status, info :VmInfo);
  # The newest installed guest; its directory, config and jail; no process. The same ID with
  # the same spec finds it; another spec is alreadyExists.
  start @1 (id :Text, waitAttach :Bool) -> (status :Common.Status, info :VmInfo);
  # Boots; with waitAttach until the guest attached (60 s, else crashed and unavailable).
  shutdown @2 (id :Text) -> (status :Common.Status, info :VmInfo);
  # The guest's Shutdown, then ACPI; killed (crashed) after the grace. Busy while late.
  suspend @3 (id :Text, purgeGuest :Bool) -> (status :Common.Status, info :VmInfo);
  # Within the suspend's budget; unavailable with vmBusy when the snapshot is late.
  resume @4 (id :Text) -> (status :Common.Status, info :VmInfo);
  delete @5 (id :Text) -> (status :Common.Status);
  get @6 (id :Text) -> (status :Common.Status, info :VmInfo);
  list @7 () -> (status :Common.Status, vms :List(VmInfo));
  subscribe @8 (sink :VmEvents) -> (status :Common.Status);
}
