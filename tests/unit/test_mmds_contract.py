"""MMDS version 2 as Firecracker answers it, the metadata's validation, and the HTTP parser."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos.errors import Code, FeosError
from feos.net._mmds import (
    BadRequest,
    MmdsStore,
    Request,
    metadata_object,
    validate_metadata,
)
from feos.net._mmds_http import NEED_MORE, parse_request

OBJ = metadata_object("22222222-3333-4444-5555-666666666666", "2001:db8:0:1::5",
                      "169.254.16.5", {"role": "web", "n": 3, "deep": {"a": "b", "c": {}}})


def _store() -> MmdsStore:
    counter = itertools.count()
    return MmdsStore(OBJ, lambda n: bytes([next(counter) % 256]) * n)


def _req(method: str, target: str, *headers: tuple[str, str]) -> Request:
    return Request(method, target, "HTTP/1.1", tuple((k.lower(), v) for k, v in headers))


def _token(store: MmdsStore, ttl: str = "60", now: float = 0.0) -> str:
    r = store.respond(_req("PUT", "/latest/api/token", ("X-metadata-token-ttl-seconds", ttl)), now)
    assert r.status == 200
    return r.body


def test_token_then_get() -> None:
    s = _store()
    tok = _token(s)
    tok2 = _token(s)
    assert tok != tok2
    r = s.respond(_req("GET", "/feos/ipv6", ("X-metadata-token", tok)), 1.0)
    assert (r.status, r.body) == (200, "2001:db8:0:1::5")
    r = s.respond(_req("GET", "/metadata/role", ("x-aws-ec2-metadata-token", tok2)), 1.0)
    assert (r.status, r.body) == (200, "web")


def test_listing_and_json() -> None:
    s = _store()
    tok = ("X-metadata-token", _token(s))
    assert s.respond(_req("GET", "/", tok), 0).body == "feos/\nmetadata/"
    assert s.respond(_req("GET", "/metadata/", tok), 0).body == "deep/\nn\nrole"
    assert s.respond(_req("GET", "//metadata//deep", tok), 0).body == "a\nc/"
    r = s.respond(_req("GET", "/feos", tok, ("Accept", "application/json")), 0)
    assert r.content_type == "application/json"
    assert json.loads(r.body) == OBJ["feos"]
    assert s.respond(_req("GET", "/metadata/n", tok, ("Accept", "application/json")), 0).body == "3"
    assert s.respond(_req("GET", "/metadata/n", tok), 0).status == 501
    absolute = _req("GET", "http://169.254.169.254/feos/ipv4?x=1", tok)
    assert s.respond(absolute, 0).body == "169.254.16.5"


def test_refusals() -> None:
    s = _store()
    tok = _token(s, ttl="5")
    assert s.respond(_req("GET", "/feos"), 0).status == 401
    assert s.respond(_req("GET", "/feos", ("X-metadata-token", "nope")), 0).status == 401
    assert s.respond(_req("GET", "/feos", ("X-metadata-token", tok)), 5.0).status == 401  # expired
    assert s.respond(_req("GET", "/nothing", ("X-metadata-token", tok)), 1.0).status == 404
    r = s.respond(_req("POST", "/feos", ("X-metadata-token", tok)), 1.0)
    assert (r.status, r.allow) == (405, "GET, PUT")
    ttl = "X-metadata-token-ttl-seconds"
    for bad in ("0", "21601", "-1", "x", ""):
        assert s.respond(_req("PUT", "/latest/api/token", (ttl, bad)), 0).status == 400, bad
    assert s.respond(_req("PUT", "/latest/api/token", (ttl, "21600")), 0).status == 200
    assert s.respond(_req("PUT", "/latest/api/token"), 0).status == 400
    fwd = _req("PUT", "/latest/api/token", (ttl, "60"), ("X-Forwarded-For", "1.2.3.4"))
    assert s.respond(fwd, 0).status == 400
    assert s.respond(_req("PUT", "/feos", (ttl, "60")), 0).status == 404


def test_validate_metadata() -> None:
    assert validate_metadata({"role": "web", "a.b-c_d": {"x": [1, {"y": None}]}})
    for bad, where in [({"": "x"}, "spec.metadata."), ({"a b": "x"}, "spec.metadata.a b"),
                       ({"k" * 129: 1}, "spec.metadata.k"),
                       ({"ok": {"bad/key": 1}}, "spec.metadata.ok.bad/key"),
                       ({"ok": [{"é": 1}]}, "spec.metadata.ok[0].é")]:
        with pytest.raises(FeosError) as e:
            validate_metadata(bad)
        assert e.value.code == Code.INVALID_ARGUMENT
        assert e.value.message.startswith(where)
    validate_metadata({"k": "x" * (32 * 1024 - 10)})
    with pytest.raises(FeosError, match="32 KiB"):
        validate_metadata({"k": "x" * (32 * 1024)})
    with pytest.raises(FeosError):
        validate_metadata(["not", "an", "object"])


def test_parser_basics() -> None:
    raw = (b"PUT /latest/api/token HTTP/1.1\r\nHost: x\r\nX-metadata-token-ttl-seconds: 9\r\n"
           b"Content-Length: 3\r\n\r\nabcGET / HTTP/1.0\r\n\r\n")
    req, used = parse_request(raw)  # type: ignore[misc]
    assert (req.method, req.target, req.body) == ("PUT", "/latest/api/token", b"abc")
    assert req.header("x-metadata-token-ttl-seconds") == "9"
    req2, used2 = parse_request(raw[used:])  # type: ignore[misc]
    assert req2.version == "HTTP/1.0"
    assert not req2.keep_alive
    assert used + used2 == len(raw)
    assert parse_request(b"GET / HTTP/1.1\r\nHost: x\r\n") is NEED_MORE
    assert parse_request(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab") is NEED_MORE
    for bad in [b"GET /\r\n\r\n", b"GET / HTTP/2\r\n\r\n", b"GET / HTTP/1.1\r\nNo colon\r\n\r\n",
                b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                b"G\x00T / HTTP/1.1\r\n\r\n", b"x" * 20000]:
        assert isinstance(parse_request(bad), BadRequest), bad


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_parser_fuzz_never_crashes(data: bytes) -> None:
    out = parse_request(data)
    assert out is NEED_MORE or isinstance(out, BadRequest | tuple)
    if isinstance(out, tuple):
        req, used = out
        assert 0 < used <= len(data)
        _store().respond(req, 0.0)  # every request the parser takes gets an answer


_names = st.text(st.sampled_from("abcXYZ-_0"), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["GET", "PUT", "DELETE"]), st.text(st.characters(min_codepoint=0x21,
       max_codepoint=0x7E), min_size=1, max_size=30), st.lists(st.tuples(_names, _names),
       max_size=5), st.integers(1, 40))
def test_parser_any_cut_point(method: str, target: str, headers: list[tuple[str, str]],
                              cut: int) -> None:
    raw = f"{method} {target} HTTP/1.1\r\nHost: x\r\n".encode()  # an HTTP/1.1 request needs one
    raw += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n"
    whole = parse_request(raw)
    assert isinstance(whole, tuple)
    assert whole[0].target == target
    assert parse_request(raw[: max(0, len(raw) - cut)]) is NEED_MORE
