"""feos.vmm: the microVM layer under the pods.

MicroVms is the service the pod service calls; a Driver (QEMU here, Firecracker where KVM runs
guests) runs one kind of VMM; choose_vmm decides the node's (feosd --vmm). docs/vmm.md describes
them.
"""

from . import _cgroup, _jail
from ._budget import SuspendBudget as SuspendBudget
from ._budget import suspend_budget as suspend_budget
from ._budget import suspend_budget_mib as suspend_budget_mib
from ._choice import VmmChoice as VmmChoice
from ._choice import choose_vmm as choose_vmm
from ._choice import vmm_name as vmm_name
from ._console import SerialLog as SerialLog
from ._console import serial_log_path as serial_log_path
from ._driver import Adopted as Adopted
from ._driver import Driver as Driver
from ._driver import Exit as Exit
from ._driver import VmHandle as VmHandle
from ._driver import VmSpec as VmSpec
from ._driver import VmState as VmState
from ._guestlink import GuestLink as GuestLink
from ._kvm import KvmProbe as KvmProbe
from ._kvm import kvm_probe as kvm_probe
from ._kvm import kvm_probe_async as kvm_probe_async
from ._qemu import QemuDriver as QemuDriver
from ._qmp import Qmp as Qmp
from ._qmp import connect_qmp as connect_qmp
from ._records import Records as Records
from ._records import VmRecord as VmRecord
from ._records import check_id as check_id
from ._service import Crashed as Crashed
from ._service import GuestAttached as GuestAttached
from ._service import GuestHandle as GuestHandle
from ._service import MicroVms as MicroVms
from ._service import Stopped as Stopped
from ._service import Suspended as Suspended
from ._service import VmEvent as VmEvent
from ._service import VmInfo as VmInfo
from ._service import guest_root as guest_root
from ._service import installed_guests as installed_guests
from ._service import newest_guest as newest_guest

# Offered under names that say what they are at the package's level:
detect_cgroups = _cgroup.detect  # the microVMs' cgroup layout below feosd's
prepare_cgroups = _cgroup.prepare
in_container = _cgroup.own_cgroup_namespace  # a cgroup namespace of its own: On Kubernetes
hand_over_cgroups = _cgroup.hand_over  # a feosd's microVMs from below its unit to --vms-cgroup
unit_cgroup = _cgroup.unit_cgroup
own_cgroup = _cgroup.own_cgroup
installed_firecrackers = _jail.installed  # the Firecracker releases installed, oldest first
