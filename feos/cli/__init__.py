"""feosctl, the command line over feosd's API."""

from ._main import main as main
