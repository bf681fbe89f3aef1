"""feosd's TCP options together: TLS, plain on loopback, --tcp-insecure, and what is refused."""

from __future__ import annotations

import pytest

from feos.daemon import parse_args


@pytest.mark.parametrize("argv", [
    ["--tcp", "127.0.0.1:1337"],
    ["--tcp", "[::1]:1337"],
    ["--tcp", "localhost:1337"],
    ["--tcp", "[::]:1337", "--tcp-insecure"],
    ["--tcp", "[::]:1337", "--tcp-client-ca", "ca.pem"],
    ["--tcp", "[::]:1337", "--tcp-client-ca", "ca.pem", "--tcp-cert", "c.pem", "--tcp-key", "k"],
])
def test_accepted(argv: list[str]) -> None:
    assert parse_args(argv).tcp == argv[1]


@pytest.mark.parametrize(("argv", "error"), [
    (["--tcp", "[::]:1337"], "--tcp [::]:1337: not a loopback address: needs --tcp-client-ca"),
    (["--tcp", "192.0.2.1:1337"], "--tcp 192.0.2.1:1337: not a loopback address"),
    (["--tcp", "node.example:1337"], "--tcp node.example:1337: not a loopback address"),
    (["--tcp-insecure"], "--tcp-insecure: needs --tcp"),
    (["--tcp-cert", "c.pem"], "--tcp-cert: needs --tcp"),
    (["--tcp", "[::]:1337", "--tcp-client-ca", "ca.pem", "--tcp-cert", "c.pem"],
     "--tcp-cert: needs --tcp-key"),
    (["--tcp", "[::]:1337", "--tcp-client-ca", "ca.pem", "--tcp-key", "k.pem"],
     "--tcp-key: needs --tcp-cert"),
    (["--tcp", "[::1]:1337", "--tcp-cert", "c.pem", "--tcp-key", "k.pem"],
     "--tcp-cert: needs --tcp-client-ca"),
    (["--tcp", "[::]:1337", "--tcp-client-ca", "ca.pem", "--tcp-insecure"],
     "--tcp-insecure: contradicts --tcp-client-ca"),
])
def test_refused_naming_the_option(argv: list[str], error: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert f"feosd: error: {error}" in capsys.readouterr().err
