@0xbc6e6e3f35c45e8c;
# The API a client reaches on <run-dir>/api.sock (and --tcp): the bootstrap capability.

using Common = import "common.capnp";
using Pod = import "pod.capnp";
using Volume = import "volume.capnp";
using Network = import "network.capnp";
using Host = import "host.capnp";
using Template = import "template.capnp";

interface Feos {
  pods @0 () -> (service :Pod.PodService);
  volumes @1 () -> (service :Volume.VolumeService);
  securityGroups @2 () -> (service :Network.SecurityGroupService);
  names @3 () -> (service :Network.NameService);
  traffic @4 () -> (service :Network.TrafficService);
  host @5 () -> (service :Host.HostService);
  mesh @6 () -> (service :Network.MeshService);
  templates @7 () -> (service :Template.TemplateService);
}
