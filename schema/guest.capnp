@0x9b720c55636cf8ab;
# The guest link: GuestService, which feos-guest serves inside the microVM, and NodeService,
# which the node serves on the same connection (both bootstrap capabilities of one two-party
# session). docs/guest.md describes the link, its hello and every method's errors.

using Common = import "common.capnp";
using Status = Common.Status;

interface GuestService {
  ping @0 () -> (status :Status, version :Text, bootId :Text, uptimeNs :UInt64);
  # The agent answers; version is the agent's (feos.guest.AGENT_VERSION).

  getTime @1 () -> (status :Status, realtimeNs :Int64);
  # The guest's CLOCK_REALTIME in ns since the epoch.

  adjustTime @2 (offsetNs :Int64) -> (status :Status, slewed :Bool);
  # Moves the guest's clock by offsetNs (positive: forward). Slewed with adjtimex(ADJ_OFFSET)
  # when |offset| <= 0.5 s (slewed = true), else stepped (slewed = false).

  setTime @3 (realtimeNs :Int64) -> (status :Status);
  # Steps CLOCK_REALTIME to realtimeNs.

  configureNetwork @4 (config :NetworkConfig) -> (status :Status);
  # Applied at once, replacing what an earlier call set; the containers' resolv.conf too.

  mountVolumes @5 (volumes :List(Volume)) -> (status :Status, outcomes :List(VolumeOutcome));
  # Every volume gets an outcome, in the request's order; status is ok unless the request
  # itself is bad (a name twice, a bad name): a volume that fails says so in its outcome.

  pullImage @6 (reference :Text, pullToken :Text) -> (status :Status, digest :Text, joined :Bool);
  # Into the image store on /data. joined: the call waited for a pull of the same image that
  # was in flight (and its token was not used).

  createContainer @7 (config :ContainerConfig) -> (status :Status, state :ContainerState);
  # Pulls the image if the store lacks it. A container of the same name and the same config
  # is found (its state returned); another fails with alreadyExists.

  startContainer @8 (name :Text) -> (status :Status, state :ContainerState);
  stopContainer @9 (name :Text, signal :UInt8, timeoutMs :UInt32) -> (status :Status, state :ContainerState);
  # signal (0: SIGTERM), then SIGKILL after timeoutMs (0: 10 s). A stopped container is found.
  deleteContainer @10 (name :Text) -> (status :Status);
  # A running container is killed first. An unknown name is notFound.
  containerState @11 (name :Text) -> (status :Status, state :ContainerState);
  listContainers @12 () -> (status :Status, containers :List(ContainerState));

  logs @13 (name :Text, source :LogStream, follow :Bool) -> (status :Status, stream :ByteStream);
  # The container's output so far, and with follow what it writes until it stops.

  exec @14 (name :Text, command :List(Text), env :List(Text), stdin :Bool, tty :Bool,
            workingDir :Text, rows :UInt16, cols :UInt16)
      -> (status :Status, process :Process, stdout :ByteStream, stderr :ByteStream);
  # A process in the running container, as the container's own process runs: its user, its
  # environment (the image's Env under the config's env) with env over it, its working
  # directory unless workingDir (absolute) is given. Without stdin, its stdin is /dev/null.
  # With tty, a terminal of rows x cols (0: 24 x 80) is its stdin, stdout and stderr (and its
  # controlling terminal): stdout carries the terminal's output, stderr only the runtime's own
  # errors, and closeStdin sends the terminal's end of file (^D).

  freezeFilesystem @15 () -> (status :Status);
  # FIFREEZE of /data; a frozen one is found.
  thawFilesystem @16 () -> (status :Status);
  # FITHAW of /data; one not frozen is found.

  prepareSuspend @17 (zeroFree :Bool) -> (status :Status, freeBytesBefore :UInt64,
                                          freeBytesAfter :UInt64);
  # sync, drop the page cache, compact memory: the balloon's free page reporting gives back.
  # zeroFree (a template's make, docs/templates.md): then every free page but a margin is
  # faulted in (the kernel zeroes it) and freed, so that pages the dropped cache held (a pull's
  # data) are zero pages in the snapshot, which QEMU's stream and its punch leave out.

  shutdown @18 (reboot :Bool) -> (status :Status);
  # Stops the containers (SIGTERM, 10 s), syncs, unmounts the volumes, powers off (or reboots).
  # Answered before the power goes.

  assume @19 (identity :Identity) -> (status :Status);
  # The pod's identity, before its containers start (every bring-up; a guest restored from a
  # template has the template's until then): the hostname and machine ID set, the network
  # device's MAC address set (a restored guest's is the snapshot's), the clock set, and the
  # kernel's random pool reseeded with the node's bytes and the agent's own; answered after.
}

struct Identity {
  podId @0 :Text;
  hostname @1 :Text;     # the guest's, and its containers' from then on
  machineId @2 :Text;    # 32 hex digits; the containers see it as /etc/machine-id
  mac @3 :Text;          # the network device's; empty: no network
  entropy @4 :Data;      # fresh random bytes of the node's, 32 or more
  realtimeNs @5 :Int64;  # the node's wall clock
}

enum LogStream {
  stdout @0;
  stderr @1;
}

interface ByteStream {
  read @0 (maxBytes :UInt32) -> (status :Status, data :Data, eof :Bool);
  # Up to maxBytes (0: 64 KiB), waiting until there is some; eof once no more will come.
  close @1 () -> (status :Status);
}

interface Process {
  writeStdin @0 (data :Data) -> (status :Status);
  closeStdin @1 () -> (status :Status);
  wait @2 () -> (status :Status, exitCode :Int32, signal :UInt8);
  # exitCode as a shell shows it: the process's code, or 128 + the signal that ended it (then
  # signal is that signal, else 0).
  kill @3 (signal :UInt8) -> (status :Status);
}

struct NetworkConfig {
  ipv6 @0 :Text;
  # The pod's IPv6 address (no prefix length: a /128), its gateway fe80::1. Empty: none.
  ipv4 @1 :Text;
  # The pod's IPv4 address (a /32), its gateway 169.254.0.1 on the link. Empty: none.
  resolvers @2 :List(Text);
  mtu @3 :UInt16;
  # 0: the device's own (1500).
  mac @4 :Text;
  # The device to configure, by MAC address; empty: the first ethernet device (eth0).
}

struct Volume {
  name @0 :Text;
  # 1 to 63 lowercase letters, digits and -; mounted at /volumes/<name>.
  id @1 :Text;
  drive @2 :UInt8;
  # 1 for the first volume (0 is the pod's data disk, not a volume).
  sizeBytes @3 :UInt64;
  # The size the node made the disk; a drive of another size is refused.
  format @4 :Bool;
  # mkfs.ext4 the drive first (only if it holds no filesystem yet).
}

struct VolumeOutcome {
  name @0 :Text;
  mounted @1 :Bool;
  error @2 :Text;
  # Why it is not mounted; empty when mounted.
}

struct VolumeMount {
  name @0 :Text;
  # A volume mounted by mountVolumes.
  path @1 :Text;
  # Absolute, in the container.
  readOnly @2 :Bool;
}

struct ContainerConfig {
  name @0 :Text;
  # 1 to 63 lowercase letters, digits and -, a letter or digit first: the container's ID.
  image @1 :Text;
  command @2 :List(Text);
  # Replaces the image's entrypoint and cmd; empty: the image's.
  env @3 :List(Text);
  # KEY=VALUE, over the image's.
  volumeMounts @4 :List(VolumeMount);
  pullToken @5 :Text;
  # A Bearer token for the image's registry; used for this pull only, never kept.
  workingDir @6 :Text;
}

enum ContainerStatus {
  created @0;
  running @1;
  stopped @2;
}

struct ContainerState {
  name @0 :Text;
  image @1 :Text;
  imageDigest @2 :Text;
  status @3 :ContainerStatus;
  pid @4 :UInt32;
  exitCode @5 :Int32;
  # As Process.wait; -1 when it is not known (the container ended while the agent was not there).
  createdNs @6 :Int64;
  startedNs @7 :Int64;
  finishedNs @8 :Int64;
}

interface NodeService {
  attach @0 (version :Text, bootId :Text, session :Text) -> (status :Status);
  # The agent calls it once per session, after its hello.
}
