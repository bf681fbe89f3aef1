"""feos.guestlink: the node's side of the guest link (docs/guest.md, "The node's side").

`GuestClient` is one session with a microVM's agent, on pycapnp and the asyncio loop of feosd's
Cap'n Proto thread; feos.vmm's GuestLink keeps a guest's sessions going. The values it takes and
gives are plain attrs classes. It shares with the agent (feos.guest) only the framing; it is
not in the guest's image.
"""

from ._client import ByteReader as ByteReader
from ._client import ExecProcess as ExecProcess
from ._client import GuestClient as GuestClient
from ._swaplink import SwapLink as SwapLink
from ._values import Attached as Attached
from ._values import ContainerConfig as ContainerConfig
from ._values import ContainerState as ContainerState
from ._values import ExecResult as ExecResult
from ._values import Identity as Identity
from ._values import NetworkConfig as NetworkConfig
from ._values import Ping as Ping
from ._values import VolumeMount as VolumeMount
from ._values import VolumeOutcome as VolumeOutcome
from ._values import VolumeSpec as VolumeSpec
