"""The quickstart's pure parts: the ULA prefix (RFC 4193) kept once, the demo image's layout."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from feos.errors import FeosError
from feos.quickstart import kept_prefix, parse, ula_prefix
from feos.quickstart._image import write_layout


def test_a_ula_is_fd_the_global_id_and_the_subnet() -> None:
    assert ula_prefix(0x1234567890) == ipaddress.IPv6Network("fd12:3456:7890::/64")
    assert ula_prefix(0xFFFFFFFFFF, 7) == ipaddress.IPv6Network("fdff:ffff:ffff:7::/64")
    with pytest.raises(ValueError, match="40-bit global ID"):
        ula_prefix(1 << 40)


def test_the_prefix_is_made_once_and_kept(tmp_path: Path) -> None:
    first, made = kept_prefix(tmp_path / "q" / "prefix")
    assert made and first.prefixlen == 64 and first.subnet_of(ipaddress.IPv6Network("fd00::/8"))
    assert kept_prefix(tmp_path / "q" / "prefix") == (first, False)
    (tmp_path / "bad").write_text("not a prefix\n")
    with pytest.raises(FeosError, match="not an IPv6 prefix"):
        kept_prefix(tmp_path / "bad")


def test_the_layout_is_the_same_image_every_time(tmp_path: Path) -> None:
    digest = write_layout(tmp_path / "a")
    assert write_layout(tmp_path / "b") == digest == write_layout(tmp_path / "a")
    index = json.loads((tmp_path / "a" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == digest


def test_unknown_options_go_to_feosd(tmp_path: Path) -> None:
    opts = parse(["--dir", str(tmp_path), "--port", "9090", "--tcp", "127.0.0.1:1337"])
    assert (opts.directory, opts.port, opts.feosd_args) == (tmp_path, 9090,
                                                             ("--tcp", "127.0.0.1:1337"))


def test_the_web_console_is_asked_for_only_when_feosd_has_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from feos.quickstart import _feosd, _run

    opts = parse(["--dir", str(tmp_path), "--web-port", "8181"])
    monkeypatch.setattr(_feosd, "has_option", lambda name: False)
    assert _run._web(opts) == ([], None)
    monkeypatch.setattr(_feosd, "has_option", lambda name: name == "--web")
    assert _run._web(opts) == (["--web", "127.0.0.1:8181"], "http://127.0.0.1:8181/")
    given = parse(["--dir", str(tmp_path), "--web", "127.0.0.1:9999"])
    assert _run._web(given) == ([], "http://127.0.0.1:9999/")
