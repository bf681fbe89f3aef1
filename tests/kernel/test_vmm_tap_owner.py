"""The QEMU driver gives a pod's TAP, made by the network before the microVM's uid existed, to
the microVM's user at its start (in a throwaway namespace, whose sysfs `ip netns exec` mounts)."""

from __future__ import annotations

import json
import sys
from typing import Any

GIVE = "import sys; from feos.vmm._qemu import give_tap; give_tap(sys.argv[1], int(sys.argv[2]))"


def _owner(netns: Any, tap: str) -> tuple[str, str, bool]:
    (link,) = json.loads(netns.run("ip", "-d", "-j", "link", "show", "dev", tap).stdout)
    data = link["linkinfo"]["info_data"]
    return str(data.get("user", "")), str(data.get("group", "")), bool(data["vnet_hdr"])


def test_a_roots_tap_is_given_to_the_microvms_user(netns: Any) -> None:
    netns.run("ip", "tuntap", "add", "dev", "pod-tap0", "mode", "tap")
    assert _owner(netns, "pod-tap0") == ("", "", False)  # root's
    netns.run(sys.executable, "-c", GIVE, "pod-tap0", "4242")
    assert _owner(netns, "pod-tap0") == ("4242", "4242", True)
    netns.run(sys.executable, "-c", GIVE, "pod-tap0", "4242")  # theirs already: left alone
    netns.run(sys.executable, "-c", GIVE, "pod-none", "4242")  # no TAP: QEMU will say so
