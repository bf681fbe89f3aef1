"""A pod's TAP name and its guest's MAC address, for short IDs and UUIDs."""

from __future__ import annotations

import hashlib

import pytest

from feos.errors import FeosError
from feos.net._links import guest_mac, tap_name


def test_names_and_macs() -> None:
    assert tap_name("22222222-3333-4444-5555-666666666666") == "pod-22222222"
    assert guest_mac("22222222-3333-4444-5555-666666666666") == "06:00:22:22:22:22"
    assert tap_name("abcdefghjkm") == "pod-abcdefghjkm"
    h = hashlib.sha256(b"abcdefghjkm").digest()[:4]
    assert guest_mac("abcdefghjkm") == "06:00:" + ":".join(f"{b:02x}" for b in h)


@pytest.mark.parametrize("bad", ["", "1bcdefghjkm", "abcdefghjkl", "abcdefghjk", "ABCDEFGHJKM"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(FeosError):
        tap_name(bad)
