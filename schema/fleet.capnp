@0xf32ba80c76916caa;
# The uplink: what a node asks of its control plane (docs/control-plane.md). The node is the
# client. Each method is one HTTP/2 stream over TLS 1.3 with ALPN h2, carried as the node
# connections carry calls (docs/node-connections.md): the path /Uplink/<method>, the body the
# method's parameters as one Cap'n Proto message, the answer's body its results, the trailers the
# status. Join is the one call made without a client certificate; every other one is made with the
# node's certificate, and PERMISSION_DENIED on it means the node was removed or revoked.

using Common = import "common.capnp";
using Pod = import "pod.capnp";
using Host = import "host.capnp";

struct Instance {
  # One instance of the control plane, where the node dials it for node connections and the uplink.
  # Its certificate is checked for --control-plane-name, as wherever the node dials.
  address @0 :Text;            # HOST:PORT ([v6]:PORT)
}

struct Event {
  # One of the node's events, numbered from 1 per start of feosd (startId tells the starts apart).
  sequence @0 :UInt64;
  timeUnixNs @1 :Int64;
  kind @2 :Text;               # "started", "stopping", "upgrading" (feosd's own) or "pod"
  podId @3 :Text;              # kind "pod": the pod, and its state, reason and step as PodEvent
  state @4 :Text;
  reason @5 :Text;
  step @6 :Text;
  deleted @7 :Bool;
}

struct Telemetry {
  node @0 :Host.HostInfo;               # the node, its feosd, its VMM
  pods @1 :List(Pod.PodInfo);           # every pod's record (no containers' states)
  podsUnixNs @2 :Int64;                 # when the pods were collected (an older list: not answered)
  versions @3 :Host.VersionInfo;        # the installed versions
  versionsUnixNs @4 :Int64;
  meshTaken @5 :Bool;                   # the last JoinMesh answer was taken by feosd's runtime
}

interface Uplink {
  join @0 (secret :Text, name :Text, csr :Data)
      -> (status :Common.Status, chain :Text, bundle :Text, instances :List(Instance),
          renewUnixNs :Int64);
  # The join: the token's secret, the node's hostname and a PKCS#10 request (DER) for its key.
  # chain: PEM, the node's certificate then its issuer; bundle: PEM, the platform CA's roots (it must
  # hold the root the token pins); renewUnixNs: when to renew (0: two thirds into the validity).
  # Refused token: PERMISSION_DENIED (sent again only once the token file holds another token).

  report @1 (startId :Text, sequence :UInt64, telemetry :Telemetry)
      -> (status :Common.Status, intervalMs :UInt32, instances :List(Instance));
  # Every 3 s, or every intervalMs once an answer asks (0: as before). instances: the control
  # plane's instances, which the node connections follow (none: --control-plane itself).

  events @2 (startId :Text, events :List(Event), dropped :UInt64)
      -> (status :Common.Status, acknowledged :UInt64);
  # The events not acknowledged yet, in order; dropped: how many of this start the node let go
  # of unsent (its buffer holds 16384). acknowledged: every event up to this sequence is taken.

  renew @3 (csr :Data) -> (status :Common.Status, chain :Text, renewUnixNs :Int64);
  # A new certificate for the same key (the node keeps its key across renewals).

  joinMesh @4 (publicKey :Data, endpoint :Text, askOnly :Bool)
      -> (status :Common.Status, meshed :Bool, ula :Text, prefix :Text);
  # publicKey: the node's WireGuard key (32 bytes) and endpoint HOST:PORT; askOnly (a node with
  # --pod-prefix): no key, only whether the cluster is meshed. meshed: the cluster's ULA /64
  # (ula, "fdxx:...::/64") and the node's /96 of it (prefix); not meshed: both empty.
}
