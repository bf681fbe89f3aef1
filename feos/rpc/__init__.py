"""Cap'n Proto RPC for feosd: the thread bridge, the API server, and the client feosctl uses."""

from ._bridge import CapnpThread as CapnpThread
from ._bridge import capnp_thread as capnp_thread
