"""The one error root of feosd: every failure a caller sees is a FeosError with a status code.

Errors from libraries are translated into it at the boundary where they are caught; the API edge
turns it into the Status of schema/common.capnp, and feosctl into an exit code.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """The status codes, numbered as gRPC numbers them so that a control plane maps them 1:1."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class FeosError(Exception):
    """A failure with a status code, a message for people and, for UNAVAILABLE, the busy marker.

    `busy` is the VmBusy marker: the microVM is being suspended or still writes a late snapshot,
    so the call changed nothing and may be asked again later.
    """

    def __init__(self, code: Code, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.busy = busy

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __repr__(self) -> str:
        return f"FeosError({self.code.name}, {self.message!r}, busy={self.busy})"


def invalid(field: str, rule: str) -> FeosError:
    """INVALID_ARGUMENT naming the field and the rule it breaks."""
    return FeosError(Code.INVALID_ARGUMENT, f"{field}: {rule}")


def busy(message: str) -> FeosError:
    """UNAVAILABLE with the VmBusy marker: "the VM is busy: ..."."""
    return FeosError(Code.UNAVAILABLE, f"the VM is busy: {message}", busy=True)
