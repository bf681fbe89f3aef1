"""Fixtures of the integration tier: real microVMs under QEMU, feosd as a process."""

from __future__ import annotations

import pytest
from _owner import exit_on_sigterm


def pytest_configure(config: pytest.Config) -> None:
    # A run ended by SIGTERM (timeout, CI) tears its fixtures down as after Ctrl-C: their
    # namespaces, feosd processes and microVMs go; _owner's atexit ends what is left.
    exit_on_sigterm()
    config.addinivalue_line("markers", "guests(wanted): the module's guests a test needs, "
                            "by ID and state (test_vmm_qemu's fixture `prepared` makes them)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.integration)


@pytest.fixture
def feosd_factory(tmp_path):  # type: ignore[no-untyped-def]
    """Make feosd processes under tmp_path; each is killed when the test ends."""
    from feosd_proc import Feosd

    made: list[Feosd] = []

    def make(*args: str, root: str = "node", env: dict[str, str] | None = None) -> Feosd:
        daemon = Feosd(tmp_path / root, *args, env=env)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.close()


@pytest.fixture
def feosd(feosd_factory):  # type: ignore[no-untyped-def]
    """One feosd serving in temporary directories."""
    return feosd_factory().start()
