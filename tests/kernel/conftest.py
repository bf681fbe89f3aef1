"""Fixtures of the kernel tier: root, and network namespaces that each test makes and removes."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.kernel)


@pytest.fixture(scope="session", autouse=True)
def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the kernel tier runs as root (it makes network namespaces)")


def run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, its output captured as text; a failure names the command and its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Netns:
    """A throwaway network namespace, named so that a leftover is recognisable (feostest-*)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", self.name, *argv, check=check, input=input)

    def popen(self, *argv: str, **kwargs: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)  # type: ignore[call-overload]


@pytest.fixture
def make_netns() -> Iterator[object]:
    """A factory of namespaces, with lo up; every one it made is deleted after the test."""
    made: list[Netns] = []

    def make(prefix: str = "n") -> Netns:
        ns = Netns(f"feostest-{prefix}-{secrets.token_hex(3)}")
        run("ip", "netns", "add", ns.name)
        made.append(ns)
        ns.run("ip", "link", "set", "lo", "up")
        return ns

    yield make
    for ns in made:
        run("ip", "netns", "delete", ns.name, check=False)


@pytest.fixture
def netns(make_netns: object) -> Netns:
    """One throwaway namespace."""
    return make_netns()  # type: ignore[operator]
