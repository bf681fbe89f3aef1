"""Checks of what the node sends, without I/O: each returns plain values or raises INVALID_ARGUMENT.

The agent trusts the node, but a bug there must end in a clear status, never in a dead agent or
a path outside where it belongs (a container name is a directory name, a mount path is joined
under a rootfs).
"""

from __future__ import annotations

import socket

from feos.errors import FeosError, invalid

TYPE_CHECKING = False  # mypy takes it as true; typing costs the guest's start
if TYPE_CHECKING:
    import re

# The patterns, compiled on first use: re's import and their compiling cost the guest's start
# tens of milliseconds under TCG, and the start checks nothing.
_PATTERNS = {
    "name": r"[a-z0-9][a-z0-9-]{0,62}",
    "volume": r"[a-z0-9-]{1,63}",
    "env_key": r"[^=\x00]+",
    "component": r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*",
    "tag": r"(?a)\w[\w.-]{0,127}",  # (?a): \w of ASCII only
    "digest": r"sha256:[0-9a-f]{64}",
    "host": r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?",
    "mac": r"[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){5}",
}
_compiled: dict[str, re.Pattern[str]] = {}


def _full(kind: str, text: str) -> bool:
    """Whether all of text matches the pattern of that kind."""
    pattern = _compiled.get(kind)
    if pattern is None:
        import re

        pattern = _compiled.setdefault(kind, re.compile(_PATTERNS[kind]))
    return pattern.fullmatch(text) is not None


MAX_ARGS = 4096
MAX_TEXT = 65536


def container_name(field: str, name: str) -> str:
    if not _full("name", name):
        raise invalid(field, "1 to 63 lowercase letters, digits and -, a letter or digit first")
    return name


def volume_name(field: str, name: str) -> str:
    if not _full("volume", name):
        raise invalid(field, "1 to 63 lowercase letters, digits and -")
    return name


def texts(field: str, items: list[str], *, allow_empty_items: bool = True) -> list[str]:
    if len(items) > MAX_ARGS:
        raise invalid(field, f"at most {MAX_ARGS} items")
    for i, item in enumerate(items):
        if "\x00" in item or len(item) > MAX_TEXT:
            raise invalid(f"{field}[{i}]", f"no NUL, at most {MAX_TEXT} characters")
        if not item and not allow_empty_items:
            raise invalid(f"{field}[{i}]", "must not be empty")
    return items


def env(field: str, items: list[str]) -> list[str]:
    texts(field, items)
    for i, item in enumerate(items):
        key, sep, _ = item.partition("=")
        if not sep or not _full("env_key", key):
            raise invalid(f"{field}[{i}]", "KEY=VALUE with a non-empty KEY")
    return items


def container_path(field: str, path: str) -> str:
    """An absolute path in a container, normalised, never / and never with .. in it."""
    if not path.startswith("/") or "\x00" in path or len(path) > 4096:
        raise invalid(field, "an absolute path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise invalid(field, "an absolute path below /, without ..")
    return "/" + "/".join(parts)


def signal_number(field: str, sig: int) -> int:
    if not 0 <= sig <= 64:
        raise invalid(field, "a signal number, 1 to 64 (0: SIGTERM)")
    return sig or 15


def ip(field: str, text: str, family: int) -> bytes:
    try:
        return socket.inet_pton(family, text)
    except (OSError, ValueError):
        kind = "IPv6" if family == socket.AF_INET6 else "IPv4"
        raise invalid(field, f"an {kind} address") from None


def any_ip(field: str, text: str) -> int:
    """The family of an address of either family."""
    for family in (socket.AF_INET6, socket.AF_INET):
        try:
            socket.inet_pton(family, text)
            return family
        except (OSError, ValueError):
            pass
    raise invalid(field, "an IPv4 or IPv6 address")


def mac(field: str, text: str) -> str:
    if not _full("mac", text):
        raise invalid(field, "a MAC address aa:bb:cc:dd:ee:ff")
    return text.lower()


class Reference:
    """A parsed image reference: registry host (as the client dials it), repository, tag, digest."""

    __slots__ = ("digest", "registry", "repository", "tag")

    def __init__(self, registry: str, repository: str, tag: str, digest: str) -> None:
        self.registry = registry
        self.repository = repository
        self.tag = tag
        self.digest = digest

    @property
    def key(self) -> str:
        """What names the image in the store and joins pulls: registry/repository@digest or :tag."""
        suffix = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{self.registry}/{self.repository}{suffix}"

    def __repr__(self) -> str:
        return f"Reference({self.key!r})"


def reference(field: str, text: str) -> Reference:
    """docker's grammar: [host[:port]/]path[:tag][@sha256:...], docker.io/library/ by default."""
    if not text or len(text) > 1024 or text != text.strip():
        raise invalid(field, "an image reference such as registry.example/app:1.2")
    rest, _, digest = text.partition("@")
    if digest and not _full("digest", digest):
        raise invalid(field, "a digest is sha256: and 64 lowercase hex digits")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        if not _full("host", first):
            raise invalid(field, f"{first!r} is not a registry host")
        registry, path = first, remainder
    else:
        registry, path = "docker.io", rest
    path, tag = _split_tag(field, path)
    if not all(_full("component", c) for c in path.split("/")):
        raise invalid(field, f"{path!r} is not a repository (lowercase components joined by /)")
    if registry == "docker.io" and "/" not in path:
        path = f"library/{path}"
    return Reference(registry, path, tag or ("" if digest else "latest"), digest)


def _split_tag(field: str, path: str) -> tuple[str, str]:
    head, colon, tag = path.rpartition(":")
    if not colon or "/" in tag:
        return path, ""
    if not _full("tag", tag):
        raise invalid(field, f"{tag!r} is not a tag")
    return head, tag


def check(ok: bool, field: str, rule: str) -> None:
    if not ok:
        raise invalid(field, rule)


__all__ = ["FeosError", "Reference"]
