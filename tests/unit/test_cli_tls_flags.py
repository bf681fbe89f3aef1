"""feosctl's TLS flags and their environment variables: when TCP is TLS, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from feos.cli._commands import UsageError
from feos.cli._main import build_parser, client_tls
from feos.rpc import ClientTls


def tls_of(argv: list[str]) -> ClientTls | None:
    return client_tls(build_parser().parse_args([*argv, "host", "info"]))  # type: ignore[no-any-return]


def test_tcp_with_a_certificate_is_tls() -> None:
    got = tls_of(["--socket", "[::1]:1337", "--tls-cert", "me.pem", "--tls-ca", "ca.pem",
                  "--tls-server-name", "node1.example.com"])
    assert got == ClientTls(Path("me.pem"), None, Path("ca.pem"), None, "node1.example.com")


def test_tcp_without_a_certificate_is_plain() -> None:
    assert tls_of(["--socket", "127.0.0.1:1337"]) is None


def test_the_environment_gives_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEOS_TLS_CERT", "env.pem")
    monkeypatch.setenv("FEOS_TLS_KEY", "env.key")
    monkeypatch.setenv("FEOS_TLS_PIN", "p" * 43)
    got = tls_of(["--socket", "node1:1337"])
    assert got == ClientTls(Path("env.pem"), Path("env.key"), None, "p" * 43, None)


def test_a_socket_path_ignores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEOS_TLS_CA", "ca.pem")  # no certificate: refused on TCP, not here
    assert tls_of(["--socket", "/run/feos/api.sock"]) is None


@pytest.mark.parametrize(("argv", "error"), [
    (["--tls-ca", "ca.pem"], "--tls-ca: needs --tls-cert"),
    (["--tls-pin", "x"], "--tls-pin: needs --tls-cert"),
    (["--tls-key", "k.pem"], "--tls-key: needs --tls-cert"),
    (["--tls-cert", "c.pem", "--tls-ca", "ca.pem", "--tls-pin", "x"],
     "--tls-pin: contradicts --tls-ca"),
])
def test_refused(argv: list[str], error: str) -> None:
    with pytest.raises(UsageError, match=error):
        tls_of(["--socket", "127.0.0.1:1337", *argv])
