"""The guest link's framing and the agent's request checks, pure and fuzzed."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from feos import _schema
from feos.errors import Code, FeosError
from feos.guest import _oci, _validate
from feos.guest._hello import (
    GUEST_HELLO,
    NODE_POKE,
    Hello,
    Scanner,
    guest_hello,
    node_poke,
    parse_line,
)
from feos.guest._proto import code_name

guest = _schema.guest()  # pycapnp's, as the node reads what the agent builds


def message(words: list[int]) -> bytes:
    """A framed Cap'n Proto message with segments of the given word counts."""
    header = struct.pack(f"<I{len(words)}I", len(words) - 1, *words)
    header += b"\0" * (len(header) % 8)
    return header + b"".join(bytes([i % 251]) * 8 * w for i, w in enumerate(words))


def feed_in_chunks(scanner: Scanner, data: bytes, cuts: list[int]) -> list[tuple[str, object]]:
    events: list[tuple[str, object]] = []
    last = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        events += scanner.feed(data[last:cut])
        last = cut
    return events


def test_hello_round_trip() -> None:
    assert parse_line(guest_hello("b00t", "5e55")) == Hello(GUEST_HELLO, ("b00t", "5e55"))
    assert parse_line(node_poke("n0nce")) == Hello(NODE_POKE, ("n0nce",))
    for bad in (
        b"FEOS-GUEST 2 a b\n",
        b"FEOS-GUEST 1 a\n",
        b"FEOS-GUEST 1 a  b\n",
        b"FEOSX 1\n",
        b"\xff\n",
    ):
        assert parse_line(bad) is None


def test_a_real_message_passes_and_a_line_between_messages_is_seen() -> None:
    msg = guest.ContainerState.new_message(name="web", pid=7).to_bytes()
    stream = msg + node_poke("abc") + msg
    events = Scanner().feed(stream)
    assert events == [("data", msg), ("line", Hello(NODE_POKE, ("abc",))), ("data", msg)]


@given(
    items=st.lists(
        st.one_of(
            st.lists(st.integers(0, 40), min_size=1, max_size=5).map(message),
            st.text("abcdef0123456789", min_size=1, max_size=20).map(node_poke),
            st.text("abcdef0123456789", min_size=1, max_size=20).map(lambda s: guest_hello(s, s)),
        ),
        max_size=12,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=30),
)
def test_messages_and_lines_survive_any_chunking(items: list[bytes], cuts: list[int]) -> None:
    events = feed_in_chunks(Scanner(), b"".join(items), cuts)
    data = b"".join(v for k, v in events if k == "data")  # type: ignore[misc]
    assert data == b"".join(i for i in items if not i.startswith(b"FEOS"))
    lines = [v for k, v in events if k == "line"]
    assert lines == [parse_line(i) for i in items if i.startswith(b"FEOS")]


@given(st.binary(max_size=4096), st.lists(st.integers(0, 5000), max_size=10))
def test_garbage_never_breaks_the_scanner(data: bytes, cuts: list[int]) -> None:
    events = feed_in_chunks(Scanner(), data, cuts)
    assert all(k in ("data", "line") for k, _ in events)


# The request checks --------------------------------------------------------------------------


def test_references() -> None:
    r = _validate.reference("f", "busybox")
    assert (r.registry, r.repository, r.tag) == ("docker.io", "library/busybox", "latest")
    r = _validate.reference("f", "10.0.2.100:5000/feos/busybox:1")
    assert (r.registry, r.repository, r.tag, r.key) == (
        "10.0.2.100:5000",
        "feos/busybox",
        "1",
        "10.0.2.100:5000/feos/busybox:1",
    )
    d = "sha256:" + "a" * 64
    r = _validate.reference("f", f"localhost/x@{d}")
    assert (r.registry, r.repository, r.tag, r.digest) == ("localhost", "x", "", d)
    for bad in ("", "UPPER/case", "x:bad tag", "x@sha256:zz", " x", "a//b", "host:99/../x"):
        try:
            _validate.reference("f", bad)
        except FeosError as e:
            assert e.code == Code.INVALID_ARGUMENT
            assert e.message.startswith("f: ")
        else:
            raise AssertionError(f"{bad!r} was taken")


@given(st.text(max_size=300))
def test_any_reference_is_taken_or_refused_cleanly(text: str) -> None:
    try:
        r = _validate.reference("image", text)
    except FeosError as e:
        assert e.code == Code.INVALID_ARGUMENT
        return
    assert ".." not in r.repository
    assert not r.repository.startswith("/")


@given(st.text(max_size=200))
def test_container_paths_stay_below_the_root(text: str) -> None:
    try:
        path = _validate.container_path("p", text)
    except FeosError as e:
        assert e.code == Code.INVALID_ARGUMENT
        return
    assert path.startswith("/")
    assert path != "/"
    assert ".." not in path.split("/")


@given(st.text(max_size=80))
def test_names(text: str) -> None:
    for check in (_validate.container_name, _validate.volume_name):
        try:
            name = check("n", text)
        except FeosError as e:
            assert e.code == Code.INVALID_ARGUMENT
            continue
        assert "/" not in name
        assert name not in (".", "..")
        assert 1 <= len(name) <= 63


@given(st.lists(st.text(max_size=30), max_size=8))
def test_env(items: list[str]) -> None:
    try:
        _validate.env("env", items)
    except FeosError as e:
        assert e.code == Code.INVALID_ARGUMENT
        return
    assert all("=" in i and not i.startswith("=") for i in items)


def test_oci_config_args_env_and_user() -> None:
    assert _oci.process_args([], {"Entrypoint": ["/e"], "Cmd": ["c"]}) == ["/e", "c"]
    assert _oci.process_args(["x"], {"Entrypoint": ["/e"]}) == ["x"]
    env = _oci.merge_env(["PATH=/bin", "A=1"], ["A=2", "B=3"])
    assert env == ["PATH=/bin", "A=2", "B=3"]
    passwd = "root:x:0:0::/:/bin/sh\napp:x:1000:1001::/:/bin/sh\n"
    assert _oci.user_ids("app", passwd, "") == (1000, 1001)
    assert _oci.user_ids("5:6", "", "") == (5, 6)
    assert _oci.user_ids("", "", "") == (0, 0)
    cfg = _oci.config(
        hostname="web",
        args=["a"],
        env=[],
        cwd="",
        uid=0,
        gid=0,
        resolv_conf="/run/r",
        binds=[("/volumes/v", "/srv", True)],
    )
    binds = [m for m in cfg["mounts"] if m["type"] == "bind"]
    assert binds[0]["destination"] == "/etc/resolv.conf"
    assert "ro" in binds[0]["options"]
    assert binds[1] == {
        "destination": "/srv",
        "type": "bind",
        "source": "/volumes/v",
        "options": ["rbind", "nosuid", "nodev", "ro"],
    }
    assert {"type": "network"} not in cfg["linux"]["namespaces"]


def test_code_names_match_the_schema() -> None:
    import capnp  # noqa: F401

    from feos.guest._proto import _BY_NAME

    with open(_schema.schema_dir() / "common.capnp") as f:
        text = f.read()
    for name in _BY_NAME:
        assert f"  {name} @" in text
    assert code_name(Code.INVALID_ARGUMENT) == "invalidArgument"


@given(st.text(max_size=50))
def test_pull_tokens_are_header_safe_and_never_shown(text: str) -> None:
    from feos.guest._service import _token

    try:
        token = _token(text)
    except FeosError as e:
        assert e.code == Code.INVALID_ARGUMENT
        # the one message, whatever the token (a token of " " is in any message)
        assert e.message == (
            "pullToken: visible ASCII characters, at most 16384 (the token is not shown)"
        )
        return
    assert token is None or token.reveal().encode("ascii") == text.encode()
