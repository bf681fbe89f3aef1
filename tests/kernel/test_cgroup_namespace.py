"""feosd finds a container by its cgroup namespace: a process that unshares one is found in it."""

from __future__ import annotations

import subprocess
import sys

PROBE = "from feos.vmm import in_container; print(in_container())"


def test_a_new_cgroup_namespace_is_a_container() -> None:
    outside = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                             check=True)
    inside = subprocess.run(["unshare", "--cgroup", sys.executable, "-c", PROBE],
                            capture_output=True, text=True, check=True)
    assert (outside.stdout, inside.stdout) == ("False\n", "True\n")
