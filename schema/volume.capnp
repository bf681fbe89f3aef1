@0xb9e3e4f18c22c20a;
# Volumes: disks that outlive the pods they are attached to (docs/api.md, "VolumeService").

using Common = import "common.capnp";

enum VolumeState {
  available @0;     # attached to no pod
  attached @1;      # a pod has it (podId)
  checkpointed @2;  # its data is in the object store alone (hibernation)
}

struct Volume {
  id @0 :Text;                  # a lowercase UUID
  sizeBytes @1 :UInt64;         # 64 MiB to 16 TiB, whole MiB
  labels @2 :List(Common.Label);
  state @3 :VolumeState;
  podId @4 :Text;               # the pod that has it, while attached or checkpointed
  formatted @5 :Bool;           # false until the guest reported it mounted
  createdUnixNs @6 :Int64;
  checkpoint @7 :Text;          # while checkpointed: the layer its disk is opened on next
}

interface VolumeService {
  createVolume @0 (id :Text, sizeBytes :UInt64, labels :List(Common.Label))
      -> (status :Common.Status, volume :Volume);
  getVolume @1 (id :Text) -> (status :Common.Status, volume :Volume);
  listVolumes @2 () -> (status :Common.Status, volumes :List(Volume));
  deleteVolume @3 (id :Text) -> (status :Common.Status);
}
