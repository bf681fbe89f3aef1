"""diskd's main: options, the lock, the recovery of the disks, the API, and its stop.

Theory of operation: `main` parses the options and runs `serve` under trio. `serve` takes
<state>/diskd.lock as feosd takes its own (waiting, and saying so, while another diskd holds it),
recovers the disks (records loaded, every started disk's data path adopted or started again),
serves DiskService on <state>/diskd.sock through feos.rpc (the Cap'n Proto thread and its
bridge, as feosd serves its API), tells systemd READY=1, and serves until SIGTERM or SIGINT.
With --stop-after-lock PATH a SIGTERM does not end it at once: it serves on until no process
holds that lock (feosd's, whose suspend on stop writes through diskd's disks), then ends.

A stop leaves every data path running: the exports are processes of their own that the next
diskd adopts, and QEMU opens its chains itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from .. import _schema
from .._lock import held, take_lock
from .._sdnotify import notify
from .._sockpath import bind_unix
from ..errors import FeosError
from ..rpc import capnp_thread, close_listeners, listen
from ..rpc import serve as serve_interface
from ..vmm import guest_root, installed_guests
from ._chunks import ChunkCache
from ._objstore import ObjectStore, StoreConfig, add_store_options
from ._service import DiskService

log = logging.getLogger("diskd")

SOCKET = "diskd.sock"
LOCK = "diskd.lock"
LOCK_POLL_S = 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diskd", description="The pods' disks: layers under tops.")
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/feos/disk"),
                   help="layers, disks, the lock and the socket (default /var/lib/feos/disk)")
    p.add_argument("--stop-after-lock", type=Path, metavar="PATH",
                   help="on SIGTERM, serve on until no process holds this lock (feosd's)")
    p.add_argument("--guest-dir", type=Path, default=None,
                   help="the installed guests, whose L0s a collect keeps (default "
                   "$FEOS_GUEST_DIR or /usr/lib/feos/guest)")
    p.add_argument("--cache-size", type=int, default=10 << 30, metavar="BYTES",
                   help="the chunk cache's limit (default 10 GiB)")
    add_store_options(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if args.cache_size < 0:
        p.error("--cache-size: must not be negative")
    return args


def open_store(args: argparse.Namespace) -> tuple[ObjectStore | None, str]:
    """The object store diskd's options and environment name (/etc/default/diskd), or why
    there is none."""
    config, reason = StoreConfig.from_env(os.environ, args)
    if config is None:
        return None, reason.removeprefix("no object store: ")
    log.info("the object store: bucket %s%s", config.bucket,
             f" at {config.endpoint}" if config.endpoint else "")
    return ObjectStore(config), ""


async def serve(args: argparse.Namespace) -> None:
    state: Path = args.state_dir
    await take_lock(state / LOCK, who="diskd")
    guests = args.guest_dir or guest_root()
    store, reason = open_store(args)
    cache = await trio.to_thread.run_sync(ChunkCache, state / "cache", args.cache_size)
    service = DiskService(state, guests=lambda: installed_guests(guests), guest_dir=guests,
                          store=store, store_reason=reason, cache=cache)
    try:
        await service.recover()
        await _serve(args, service)
    finally:
        if store is not None:
            store.close()


async def _serve(args: argparse.Namespace, service: DiskService) -> None:
    state: Path = args.state_dir
    log.info("recovered %d disks on %d layers", len(service.disks), len(service.layers))
    interface = _schema.disk().DiskService
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with capnp_thread() as bridge:
            sock = bind_unix(state / SOCKET)

            def bootstrap() -> object:
                return serve_interface(interface, service, bridge)

            server = await bridge.call(listen, sock, bootstrap)
            log.info("serving on %s", state / SOCKET)
            notify("READY=1")
            async for signum in signals:
                log.info("%s: stopping", signal.Signals(signum).name)
                break
            if args.stop_after_lock is not None:
                await _until_free(args.stop_after_lock)
            await bridge.call(close_listeners, [server])


async def _until_free(lock: Path) -> None:
    said = False
    while await trio.to_thread.run_sync(held, lock):
        if not said:
            log.info("serving on until no process holds %s", lock)
            said = True
        await trio.sleep(LOCK_POLL_S)
    log.info("nothing holds %s: ending", lock)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s diskd %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(serve, args)
    except KeyboardInterrupt:
        pass
    except FeosError as exc:
        sys.exit(f"diskd: {exc.message}")
