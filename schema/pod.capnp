@0xde9401cd66d5f45e;
# Pods: microVMs with containers inside (docs/api.md, "PodService").

using Common = import "common.capnp";

struct KeyValue {
  key @0 :Text;
  value @1 :Text;
}

struct VolumeMount {
  volume @0 :Text;               # a name of PodSpec.volumes
  path @1 :Text;                 # absolute, inside the container
  readOnly @2 :Bool;
}

struct ContainerSpec {
  name @0 :Text;                 # one lowercase DNS label, unique in the pod; the guest's ID
  image @1 :Text;                # an OCI reference: registry/repository[:tag|@digest]
  command @2 :List(Text);        # empty: the image's entrypoint and cmd
  env @3 :List(KeyValue);
  volumeMounts @4 :List(VolumeMount);
  workingDir @5 :Text;
}

struct PodVolume {
  name @0 :Text;                 # 1 to 63 of lowercase letters, digits and -
  volumeId @1 :Text;             # a Volume's ID on this node
}

struct PublishedPort {
  # A port of the node forwarded to the pod over both families (docs/network.md, "Published ports").
  protocol @0 :Text;             # tcp or udp; empty: tcp
  hostAddress @1 :Text;          # one of the node's addresses; empty: every address, both families
  hostPort @2 :UInt32;           # 1 to 65535 (32 bits so that a bad number is refused by name)
  podPort @3 :UInt32;            # 1 to 65535
}

struct PodNetwork {
  securityGroups @0 :List(Text); # none: the default group (out to the internet, nothing in)
  nameTables @1 :List(Text);
  dnsUpstreams @2 :List(Text);   # IP addresses; none: feosd's --dns-upstream
  publish @3 :List(PublishedPort); # admitted without a security group; no two may overlap
}

struct PodSpec {
  vcpus @0 :UInt32;              # 1 to 32
  memoryMib @1 :UInt32;          # 128 to 262144, a multiple of 2
  containers @2 :List(ContainerSpec);
  network :union {
    pod @3 :PodNetwork;          # the default: a network with the default group
    none @4 :Void;               # no network at all
  }
  volumes @5 :List(PodVolume);   # at most eight
  metadataJson @6 :Text;         # a JSON object: keys of 1 to 128 of [A-Za-z0-9._-], 32 KiB at most
  diskSizeMib @7 :UInt32;        # the pod's disk; 0: the guest's blank data volume's size
}

struct ImageLayers {
  # A baked image (ADR 0025): kept in the record, never compared with the spec.
  image @0 :Text;
  layers @1 :List(Text);
  mayBake @2 :Bool;
}

enum PodState {
  pending @0;                    # recorded, being brought up
  running @1;
  stopped @2;
  failed @3;                     # reason says why
  suspended @4;
  hibernated @5;
  deleting @6;
}

enum ContainerState {
  unknown @0;
  created @1;
  running @2;
  exited @3;
}

struct ContainerStatus {
  name @0 :Text;
  state @1 :ContainerState;
  exitCode @2 :Int32;
  pid @3 :UInt32;
  startedUnixNs @4 :Int64;
  finishedUnixNs @5 :Int64;
}

struct Hibernation {
  # A hibernation in flight (docs/pods.md, "Hibernate and restore").
  phase @0 :Text;                # suspend, seal, upload, commit, release
  bytesDone @1 :UInt64;          # of what goes to the object store
  bytesTotal @2 :UInt64;
  noAbandon @3 :Bool;            # a Resume waits for it instead of abandoning it
  committed @4 :Bool;            # past the commit point: a Resume waits and restores
}

struct PodInfo {
  # Also the pod's record, <state-dir>/pods/<id>.pb.
  id @0 :Text;
  spec @1 :PodSpec;
  state @2 :PodState;
  reason @3 :Text;
  ipv6Address @4 :Text;
  ipv4Address @5 :Text;
  containers @6 :List(ContainerStatus);  # the guest's answer, while the pod runs
  createdUnixNs @7 :Int64;
  changedUnixNs @8 :Int64;
  guestVersion @9 :Text;
  driver @10 :Text;              # qemu or firecracker
  imageLayers @11 :ImageLayers;
  disk @12 :Text;                # what its disk was made on: "blank:<guest version>" or "layer:<digest>"
  step @13 :Text;                # the bring-up's step while pending: vmm-probe, disk, vm, guest, volumes, containers
  generation @14 :UInt64;        # counts the pod's changes; a new pod of the same ID starts anew
  baked @15 :Text;               # the layer baked of the pod's image, once it is in the object store
  checkpoint @16 :Text;          # while hibernated: its checkpoint in the object store (sha256:...)
  hibernation @17 :Hibernation;  # while a hibernation runs
  cameUp @18 :Text;              # its last bring-up's way: "cold" (a boot), or "template:<name>"
                                 # (restored from that template, docs/templates.md)
}

struct PodEvent {
  podId @0 :Text;
  state @1 :PodState;
  reason @2 :Text;
  step @3 :Text;
  timeUnixNs @4 :Int64;
  sequence @5 :UInt64;           # from 1 per start of feosd
  deleted @6 :Bool;
}

interface EventStream {
  next @0 (max :UInt32) -> (status :Common.Status, events :List(PodEvent), end :Bool);
  # waits for at least one event; end: no more will come (feosd stops)
}

interface ByteStream {
  # Output of an exec or of logs, pulled by the caller.
  read @0 () -> (status :Common.Status, stdout :Data, stderr :Data, exited :Bool, exitCode :Int32);
  # waits for some output; exited with the exit code once the process ended and all was read
  write @1 (data :Data, close :Bool) -> (status :Common.Status);
  # the process's stdin; close ends it
}

interface PodService {
  createPod @0 (id :Text, spec :PodSpec, pullToken :Text, imageLayers :ImageLayers)
      -> (status :Common.Status, pod :PodInfo);
  getPod @1 (id :Text) -> (status :Common.Status, pod :PodInfo);
  listPods @2 () -> (status :Common.Status, pods :List(PodInfo));
  startPod @3 (id :Text, pullToken :Text) -> (status :Common.Status, pod :PodInfo);
  stopPod @4 (id :Text) -> (status :Common.Status, pod :PodInfo);
  deletePod @5 (id :Text) -> (status :Common.Status);
  suspendPod @6 (id :Text) -> (status :Common.Status, pod :PodInfo);
  resumePod @7 (id :Text) -> (status :Common.Status, pod :PodInfo);
  hibernatePod @8 (id :Text, noAbandon :Bool) -> (status :Common.Status, pod :PodInfo);
  # The pod's memory and disks into the object store as a checkpoint; HIBERNATED (docs/pods.md).
  restorePod @9 (id :Text, spec :PodSpec, checkpoint :Text) -> (status :Common.Status, pod :PodInfo);
  # A checkpoint made on any node taken over here, as the pod of that ID: RUNNING (or STOPPED).
  execInPod @10 (id :Text, container :Text, command :List(Text), env :List(KeyValue), tty :Bool,
                 workingDir :Text, rows :UInt16, cols :UInt16)
      -> (status :Common.Status, stream :ByteStream);
  # As docker exec: in the container's working directory (workingDir, absolute, instead) with its
  # environment, env over it. tty: a terminal of rows x cols (0: 24 x 80); its output is stdout.
  podLogs @11 (id :Text, container :Text, follow :Bool) -> (status :Common.Status, stream :ByteStream);
  watchEvents @12 (podId :Text) -> (status :Common.Status, stream :EventStream);
  # podId empty: every pod's events
  consoleLog @13 (id :Text, follow :Bool) -> (status :Common.Status, stream :ByteStream);
  # the microVM's serial console since its last boot (stdout only); follow: until it stops
}
