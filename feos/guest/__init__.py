"""feos-guest, the agent inside the microVM, and the node's client of it.

Imports nothing: the guest's start time depends on it.
"""

# The node's client is imported on first use (PEP 562), so that the agent's import of
# feos.guest.__main__ pulls in neither attrs nor anything else of the node's.
_CLIENT_NAMES = (
    "GuestClient", "Attached", "Ping", "NetworkConfig", "VolumeSpec", "VolumeOutcome",
    "VolumeMount", "ContainerConfig", "ContainerState", "ExecResult", "ExecProcess", "ByteReader",
)  # fmt: skip


def __getattr__(name: str) -> object:
    if name in _CLIENT_NAMES:
        from . import _client

        return getattr(_client, name)
    raise AttributeError(f"module 'feos.guest' has no attribute {name!r}")


__all__ = list(_CLIENT_NAMES)
