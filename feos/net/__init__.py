"""feos.net: the pods' network (docs/network.md).

`Network` is the one service feosd runs (feos.pods' PodNetworkService); `TrafficService` serves
its records. PodNet, Link, GuestNetwork and PodsView are the contract between the pods and their
network, which the network provides and feos.pods consumes (feos.net imports nothing of
feos.pods). The parts below it are offered for the daemon, the pod service and the tests (the
table compiler's own PodNet stays feos.net._nft.PodNet, not offered here).
"""

from ._addresses import Ipv4Allocator as Ipv4Allocator
from ._addresses import Ipv6Allocator as Ipv6Allocator
from ._contract import GuestNetwork as GuestNetwork
from ._contract import Link as Link
from ._contract import PodNet as PodNet
from ._contract import PodsView as PodsView
from ._contract import PublishedPort as PublishedPort
from ._dnscache import AnswerCache as AnswerCache
from ._dnsserver import DnsCounters as DnsCounters
from ._dnsserver import DnsServer as DnsServer
from ._dnsupstream import validate_upstreams as validate_upstreams
from ._groups import Block as Block
from ._groups import GroupPeer as GroupPeer
from ._groups import Ports as Ports
from ._groups import Protocol as Protocol
from ._groups import Rule as Rule
from ._groups import SecurityGroup as SecurityGroup
from ._groups import validate_group as validate_group
from ._groups import validate_pod_groups as validate_pod_groups
from ._links import NodeSetup as NodeSetup
from ._links import TapSpec as TapSpec
from ._links import delete_tap as delete_tap
from ._links import guest_mac as guest_mac
from ._links import make_bare_tap as make_bare_tap
from ._links import make_tap as make_tap
from ._links import prepare_node as prepare_node
from ._links import tap_name as tap_name
from ._listenfds import DnsSockets as DnsSockets
from ._listenfds import bind_dns_sockets as bind_dns_sockets
from ._listenfds import prepare_exec as prepare_exec
from ._listenfds import take_dns_sockets as take_dns_sockets
from ._mesh import Mesh as Mesh
from ._mesh import NoMesh as NoMesh
from ._mesh import mesh_key as mesh_key
from ._mesh_model import MeshState as MeshState
from ._mesh_model import Peer as Peer
from ._metadata_server import MetadataServer as MetadataServer
from ._mmds import MmdsStore as MmdsStore
from ._mmds import metadata_object as metadata_object
from ._mmds import validate_metadata as validate_metadata
from ._nametable import NameTable as NameTable
from ._nametable import NameTableDelta as NameTableDelta
from ._nametable import apply_delta as apply_delta
from ._nametable import is_label as is_label
from ._nametable import lookup_name as lookup_name
from ._nft import NodeFacts as NodeFacts
from ._nft import Table as Table
from ._nft import compile_table as compile_table
from ._nft import plan as plan
from ._nft import render_full as render_full
from ._options import NetworkOptions as NetworkOptions
from ._options import add_network_arguments as add_network_arguments
from ._options import network_options_from_args as network_options_from_args
from ._options import parse_network_options as parse_network_options
from ._ports import check_publish as check_publish
from ._service import Network as Network
from ._stores import NameTableService as NameTableService
from ._stores import SecurityGroupService as SecurityGroupService
from ._table import NftLoader as NftLoader
from ._table import TableWriter as TableWriter
from ._table import run_table as run_table
from ._traffic import DnsQuery as DnsQuery
from ._traffic import Drop as Drop
from ._traffic import Flow as Flow
from ._traffic import PodDirectory as PodDirectory
from ._traffic import Record as Record
from ._traffic import RecordHub as RecordHub
from ._traffic import ServerName as ServerName
from ._traffic import TrafficCollector as TrafficCollector
from ._traffic import delete_conntrack as delete_conntrack
from ._traffic import enable_accounting as enable_accounting
from ._traffic_service import TrafficService as TrafficService
from ._traffic_service import TrafficStream as TrafficStream
from ._traffic_service import record_dict as record_dict
from ._wireguard import UapiDevice as UapiDevice
from ._wireguard import choose_device as choose_device
