"""systemd's readiness protocol: READY=1 to $NOTIFY_SOCKET, if systemd set one."""

from __future__ import annotations

import os
import socket


def notify(state: str = "READY=1", environ: dict[str, str] | None = None) -> bool:
    """Send state to the notify socket; False when there is none."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(state.encode(), address)
    return True
