"""The clock, by NTP: the servers in the spec's order, five seconds each, the first that answers
sets the clock. The messages are ntplib's (NTPPacket, NTPStats); the exchange is an asyncio
socket here, so that no thread waits in PID 1."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence

import ntplib

from . import _system
from ._plan import NTP_WAIT_S, NtpServer

log = logging.getLogger("feos.hostinit.ntp")


async def _address(server: NtpServer) -> tuple[int, tuple[object, ...]]:
    family = socket.AF_INET6 if server.family == 6 else socket.AF_INET
    infos = await asyncio.get_running_loop().getaddrinfo(
        server.host, 123, family=family, type=socket.SOCK_DGRAM
    )
    return family, infos[0][4]


async def query(server: NtpServer, wait: float = NTP_WAIT_S) -> float:
    """The offset of our clock from the server's, in seconds; OSError or TimeoutError if it
    cannot be reached or does not answer within `wait`."""
    loop = asyncio.get_running_loop()
    family, address = await asyncio.wait_for(_address(server), wait)
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        packet = ntplib.NTPPacket(
            mode=3, version=4, tx_timestamp=ntplib.system_to_ntp_time(time.time())
        )
        await loop.sock_sendto(sock, packet.to_data(), address)
        data = await asyncio.wait_for(loop.sock_recv(sock, 256), wait)
        stats = ntplib.NTPStats()
        stats.from_data(data)
        stats.dest_timestamp = ntplib.system_to_ntp_time(time.time())
    if stats.stratum == 0 or stats.tx_timestamp == 0:
        raise OSError(f"{server.host}: no time to give (stratum {stats.stratum})")
    return float(stats.offset)


async def sync_once(servers: Sequence[NtpServer]) -> NtpServer | None:
    """Ask the servers in order until one answers, and set the clock by it."""
    for server in servers:
        try:
            offset = await query(server)
        except (OSError, TimeoutError, ntplib.NTPException) as exc:
            why = "no answer in 5 s" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("NTP: %s (IPv%d): %s", server.host, server.family, why)
            continue
        try:
            if not _system.SANDBOX:
                time.clock_settime(time.CLOCK_REALTIME, time.time() + offset)
        except OSError as exc:
            log.error("NTP: the clock cannot be set: %s", exc)
            return None
        log.info(
            "NTP: the clock set by %s (IPv%d), offset %+.3f s", server.host, server.family, offset
        )
        return server
    log.warning("NTP: no server answered; the clock stays as it is")
    return None
