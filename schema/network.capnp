@0xc98d48bb5ed1ad21;
# Security groups, name tables, the mesh, and traffic records (docs/api.md, docs/network.md).

using Common = import "common.capnp";

# -- security groups ---------------------------------------------------------------------------

enum Protocol {
  any @0;
  tcp @1;
  udp @2;
  icmp @3;      # of IPv4 blocks only
  icmpv6 @4;    # of IPv6 peers only
}

struct AddressBlock {
  cidr @0 :Text;                 # of either family
  except @1 :List(Text);         # CIDRs inside it, of its family
}

struct Rule {
  protocol @0 :Protocol;
  firstPort @1 :UInt16;          # 0 with lastPort 0: every port; tcp and udp only
  lastPort @2 :UInt16;
  peer :union {
    block @3 :AddressBlock;
    group @4 :Text;              # the members of that group: the IPv6 addresses of its pods
  }
}

struct SecurityGroup {
  id @0 :Text;
  rulesIn @1 :List(Rule);        # what may reach the group's pods (IPv4 blocks ignored)
  rulesOut @2 :List(Rule);       # what the group's pods may reach
}

interface SecurityGroupService {
  putSecurityGroup @0 (group :SecurityGroup) -> (status :Common.Status, group :SecurityGroup);
  getSecurityGroup @1 (id :Text) -> (status :Common.Status, group :SecurityGroup);
  listSecurityGroups @2 () -> (status :Common.Status, groups :List(SecurityGroup));
  deleteSecurityGroup @3 (id :Text) -> (status :Common.Status);
}

# -- name tables -------------------------------------------------------------------------------

struct Name {
  name @0 :Text;                 # one DNS label, lower case
  addresses @1 :List(Text);      # one or more IPv6 or IPv4 addresses
}

struct NameTable {
  id @0 :Text;
  version @1 :UInt64;
  names @2 :List(Name);
  includes @3 :List(Text);       # other tables' IDs, in order; their includes are not followed
}

interface NameService {
  putNameTable @0 (table :NameTable) -> (status :Common.Status, table :NameTable);
  updateNameTable @1 (id :Text, fromVersion :UInt64, toVersion :UInt64,
                      put :List(Name), remove :List(Text))
      -> (status :Common.Status, table :NameTable);
      # refused with failedPrecondition unless fromVersion is the version the node has
  getNameTable @2 (id :Text) -> (status :Common.Status, table :NameTable);
  listNameTables @3 () -> (status :Common.Status, tables :List(NameTable));
  deleteNameTable @4 (id :Text) -> (status :Common.Status);
}

# -- the mesh (decided, not built yet: every method answers unimplemented) ---------------------

struct MeshPeer {
  publicKey @0 :Data;            # 32 bytes
  endpoint @1 :Text;             # ADDRESS:PORT
  prefix @2 :Text;               # the peer's /96
}

struct Mesh {
  ula @0 :Text;                  # the cluster's ULA /64
  nodePrefix @1 :Text;           # the node's /96 of it
  publicKey @2 :Data;
  port @3 :UInt16;
  version @4 :UInt64;
  peers @5 :List(MeshPeer);
}

struct MeshUpdate {
  # One UpdateMeshPeers as mesh/.journal keeps it beside mesh.pb (docs/network.md).
  fromVersion @0 :UInt64;
  toVersion @1 :UInt64;
  put @2 :List(MeshPeer);
  remove @3 :List(Data);
}

interface MeshService {
  putMeshPeers @0 (version :UInt64, peers :List(MeshPeer)) -> (status :Common.Status);
  updateMeshPeers @1 (fromVersion :UInt64, toVersion :UInt64, put :List(MeshPeer),
                      remove :List(Data)) -> (status :Common.Status);
  getMesh @2 () -> (status :Common.Status, mesh :Mesh);
}

# -- traffic records ---------------------------------------------------------------------------

struct Flow {
  podId @0 :Text;
  protocol @1 :UInt8;            # IP protocol number
  source @2 :Text;               # ADDRESS:PORT, the original direction's
  destination @3 :Text;
  bytesOut @4 :UInt64;
  bytesIn @5 :UInt64;
  packetsOut @6 :UInt64;
  packetsIn @7 :UInt64;
  startUnixNs @8 :Int64;
  endUnixNs @9 :Int64;           # 0 while it lasts
  event @10 :Text;               # new, update, destroy
}

struct Drop {
  podId @0 :Text;
  reason @1 :Text;               # spoofed, deny, no-rule, ...
  source @2 :Text;
  destination @3 :Text;
  protocol @4 :UInt8;
}

struct ServerName {
  podId @0 :Text;
  name @1 :Text;                 # a TLS ClientHello's server name or an HTTP request's Host
  kind @2 :Text;                 # tls, http
  destination @3 :Text;
}

struct DnsQuery {
  podId @0 :Text;
  name @1 :Text;
  type @2 :UInt16;
  rcode @3 :UInt8;
  answers @4 :List(Text);
  upstream @5 :Text;             # empty for the resolver's own answers
}

struct TrafficRecord {
  timeUnixNs @0 :Int64;
  missed @1 :UInt64;             # records lost on the way since the one before
  union {
    flow @2 :Flow;
    drop @3 :Drop;
    serverName @4 :ServerName;
    dnsQuery @5 :DnsQuery;
  }
}

interface TrafficStream {
  next @0 (max :UInt32) -> (status :Common.Status, records :List(TrafficRecord), end :Bool);
  # waits for at least one record; end means no more will come
}

interface TrafficService {
  watchTraffic @0 (podId :Text) -> (status :Common.Status, stream :TrafficStream);
  # podId empty: every pod's
}
