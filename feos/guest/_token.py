"""A registry's pull token: never shown, never kept (spec: image_service::PullToken)."""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any


class PullToken:
    """A registry's Bearer token: its repr and str never show it, and nothing writes it down."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def reveal(self) -> str:
        return self._secret

    def __repr__(self) -> str:
        return "PullToken(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a PullToken is not to be pickled")
