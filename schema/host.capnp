@0xe467cef9f5c71d22;
# The node itself (docs/api.md, "HostService").

using Common = import "common.capnp";

struct VersionInfo {
  feosd @0 :Text;
  python @1 :Text;
  guests @2 :List(Text);         # installed guest versions, newest first
  firecrackers @3 :List(Text);   # installed Firecracker versions, newest first
  driver @4 :Text;               # qemu or firecracker: what boots pods on this node (HostInfo.vmm)
  accel @5 :Text;                # kvm or tcg, and why (HostInfo.vmm says it in fields)
  network @6 :Text;              # the pods' network: "up" or why it is not
}

struct VmmInfo {
  # The VMM this node boots pods with, decided at feosd's start (docs/vmm.md, "Which VMM").
  # A pod keeps the VMM it booted with while it runs or is suspended (PodInfo's driver).
  driver @0 :Text;               # "firecracker" or "qemu"
  accel @1 :Text;                # "kvm" or "tcg"
  reason @2 :Text;               # why: the probes' answers, for people
  requested @3 :Text;            # feosd --vmm: "auto", "firecracker" or "qemu"
  microvms @4 :List(VmmCount);   # the microVMs this feosd serves, by VMM
}

struct VmmCount {
  driver @0 :Text;
  count @1 :UInt32;
}

struct HostInfo {
  hostname @0 :Text;
  kernel @1 :Text;
  bootId @2 :Text;
  pid @3 :UInt32;
  startedUnixNs @4 :Int64;
  version @5 :VersionInfo;
  selfUpgrade @6 :Bool;
  vmm @7 :VmmInfo;
  meshDevice @8 :Text;           # which WireGuard runs feos-mesh: the kernel's (generic netlink)
                                 # or wireguard-go (its UAPI socket); "" off a mesh
}

interface HostService {
  getHostInfo @0 () -> (status :Common.Status, info :HostInfo);
  reboot @1 () -> (status :Common.Status);
  shutdown @2 () -> (status :Common.Status);
  upgradeFeosBinary @3 (binary :Data, sha256 :Text) -> (status :Common.Status);
  # verifies the sha256 (hex) of binary, replaces feosd's program and executes it with the same
  # pid, keeping the lock and the listening sockets; only with --self-upgrade
  getControlPlane @4 () -> (status :Common.Status, info :ControlPlaneInfo);
  # the control-plane link (feosctl host control-plane): the identity, the node connections and
  # the uplink; configured = false without --control-plane
}

struct ControlPlaneInfo {
  configured @0 :Bool;
  controlPlane @1 :Text;         # --control-plane HOST:PORT
  identity @2 :NodeIdentity;     # unset (empty name) before the join
  connections @3 :List(NodeConnection);
  uplink @4 :UplinkState;
}

struct NodeIdentity {
  name @0 :Text;
  spiffeId @1 :Text;
  notAfterUnixNs @2 :Int64;      # the certificate's end
  renewUnixNs @3 :Int64;         # when it is renewed
}

struct NodeConnection {
  # One node connection (feos.fleet NodeConnections.info()).
  address @0 :Text;
  serverName @1 :Text;
  state @2 :Text;                # connected, dialing, waiting (the backoff), stopping
  streams @3 :UInt32;            # calls in flight
  detail @4 :Text;               # what else the connection says of itself, for people
}

struct UplinkState {
  state @0 :Text;                # waiting (for the resumes), joining, refused, joined, removed, stopped
  instance @1 :Text;             # the instance the uplink calls now
  lastReportUnixNs @2 :Int64;    # the last report answered
  reportsHeld @3 :Bool;          # the 90 s rule holds the reports back
  eventsPending @4 :UInt64;
  eventsDropped @5 :UInt64;
  meshed @6 :Bool;               # the last JoinMesh answer
  meshUla @7 :Text;
  meshPrefix @8 :Text;
  lastError @9 :Text;
}
