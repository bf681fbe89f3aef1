"""A restored pod's memory served lazily: the handler side of Firecracker's Uffd memory backend.

docs/disk.md ("Serving memory lazily") has the protocol, the states and the recovery.

Theory of operation. `serveMemory(id, digest, socket)` listens on the pod's memory.sock; the
VMM connects (its snapshot/load with backend_type Uffd), sends its guest memory's regions as
JSON (base_host_virt_addr, size, offset into the snapshot file, page_size) with its userfaultfd
beside them (SCM_RIGHTS), and restores. From then on one thread of diskd's per pod reads the
userfaultfd's events: a page fault at an address is a page of the snapshot file (the region's
offset plus the distance into it), in one of the snapshot's 4 MiB chunks; the chunk comes from
the chunk cache or the object store (checked against its digest), and every page of it that the
VMM lacks is copied in at once (UFFDIO_COPY; a chunk of zeroes by UFFDIO_ZEROPAGE), the next
PREFETCH chunks fetched into the cache meanwhile (a fault on one of them waits for that
fetch). A removal (UFFD_EVENT_REMOVE: the VMM let pages go, a balloon's madvise) makes those
pages zero pages at their next fault. `fillMemory` copies in whatever is still missing: after
it, the VMM's memory is whole (a suspend that follows reads nothing through the handler).

Which pages the VMM has is a byte per page here (MISSING, IN, REMOVED); a copy onto a page that
is there already stops with EEXIST, which marks it IN and goes on, so the map may start empty.

The VMM's liveness is its pidfd (from the connection's SO_PEERCRED): when it exits, its server
ends. A restart of diskd: the record DIR/memory/<id>.json (the digest, the regions, the pid and
its start time, the removed ranges) lets the next diskd take the userfaultfd back from the VMM
itself (pidfd_getfd of the VMM's own copy, found in /proc/PID/fd), wake every thread that waited
on a fault the old diskd had read (UFFDIO_WAKE), and serve on. Where that cannot be done (the
record is unreadable, the fd is not found, the snapshot's manifest cannot be had), or a chunk
cannot be fetched after the store's tries, the VMM is killed (its vCPUs would wait forever) and
the server is FAILED with the reason: feosd sees its VMM end and reads why with getMemoryServer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from .. import native
from ..errors import Code, FeosError
from ._chunks import ChunkCache, unlink_quietly
from ._files import write_json
from ._objstore import MemoryManifest, ObjectStore

log = logging.getLogger(__name__)

PAGE = 4096
MISSING, IN, REMOVED = 0, 1, 2
CONNECT_TIMEOUT_S = 120.0  # from serveMemory to the VMM's handshake
HANDSHAKE_MAX = 1 << 20
FETCH_ROUNDS = 3  # a chunk's fetch (each with the store's own tries) before the VMM is failed
PREFETCH = 4  # chunks fetched into the cache ahead of a fault
EVENTS_AT_ONCE = 64

LISTENING, SERVING, FILLED, ENDED, FAILED = "listening", "serving", "filled", "ended", "failed"


@attrs.frozen
class Region:
    """One of the VMM's guest memory regions: where it is mapped in the VMM, its size, and
    where its bytes are in the snapshot file."""

    base: int
    size: int
    offset: int
    page_size: int

    @classmethod
    def from_record(cls, record: object) -> Region:
        if not isinstance(record, dict):
            raise FeosError(Code.INVALID_ARGUMENT, "memory region: not a JSON object")
        try:
            region = cls(int(record["base_host_virt_addr"]), int(record["size"]),
                         int(record["offset"]), int(record.get("page_size", PAGE)))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise FeosError(Code.INVALID_ARGUMENT, f"memory region {record}: {exc}") from None
        if region.page_size != PAGE:
            raise FeosError(Code.INVALID_ARGUMENT, f"memory region of pages of "
                            f"{region.page_size} bytes: only {PAGE}-byte pages are served "
                            "(no huge pages)")  # fmt: skip
        if region.size <= 0 or region.size % PAGE or region.offset % PAGE or region.base % PAGE:
            raise FeosError(Code.INVALID_ARGUMENT, f"memory region {record}: not page-aligned")
        return region

    def record(self) -> dict[str, int]:
        return {"base_host_virt_addr": self.base, "size": self.size, "offset": self.offset,
                "page_size": self.page_size}  # fmt: skip


def _start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot): with the pid, its identity."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[19])


def _peer_pid(conn: socket.socket) -> int:
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


def _vmm_uffd(pid: int) -> int:
    """The fd number of the userfaultfd the process holds."""
    for entry in os.scandir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(entry.path) == "anon_inode:[userfaultfd]":
                return int(entry.name)
    raise FeosError(Code.FAILED_PRECONDITION, f"process {pid} holds no userfaultfd")


class MemoryServer:
    """One pod's memory, served from `manifest` to one VMM; its serving runs on a thread."""

    def __init__(self, server_id: str, manifest: MemoryManifest, socket_path: Path,
                 record_path: Path, store: ObjectStore | None, cache: ChunkCache
                 ) -> None:  # fmt: skip
        self.id = server_id
        self.manifest = manifest
        self.socket_path = socket_path
        self._record_path = record_path
        self._store = store
        self._cache = cache
        self.state = LISTENING
        self.reason = ""
        self.recovered = False
        self.vmm_pid = 0
        self._vmm_start = 0
        self.regions: list[Region] = []
        self.faults = 0
        self.pages_in = 0
        self._pages = bytearray(-(-manifest.size_bytes // PAGE))
        self._lock = threading.Lock()  # the page map and the counters
        self._uffd = -1
        self._pidfd = -1
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = threading.Event()
        self._prefetch = concurrent.futures.ThreadPoolExecutor(PREFETCH, "prefetch")
        self._prefetched: dict[int, concurrent.futures.Future[None]] = {}
        self._thread: threading.Thread | None = None
        self._removed: list[tuple[int, int]] = []  # file offsets, as recorded
        self.ended = threading.Event()
        self.owner_uid = 0
        self._events = native.uffd_constants()

    # -- start: a new server, or one taken over from the diskd before

    def listen(self, owner_uid: int) -> None:
        """Bind the socket (owned by the VMM's user, 0600) and serve on a thread."""
        self.owner_uid = owner_uid
        unlink_quietly(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(self.socket_path))
            os.chown(self.socket_path, owner_uid, -1)
            os.chmod(self.socket_path, 0o600)
            listener.listen(1)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._keep()
        self._start(self._accept_then_serve)

    def adopt(self, record: dict[str, Any]) -> None:
        """Serve on for the VMM a previous diskd served (its record): its userfaultfd taken
        back from the VMM; FeosError when that cannot be (the caller fails the VMM)."""
        self.recovered = True
        self.regions = [Region.from_record(r) for r in record["regions"]]
        self.vmm_pid, self._vmm_start = int(record["vmm_pid"]), int(record["vmm_start"])
        self._removed = [(int(a), int(b)) for a, b in record.get("removed", [])]
        for start, end in self._removed:
            self._mark_file(start, end, REMOVED)
        try:
            if _start_time(self.vmm_pid) != self._vmm_start:
                raise ProcessLookupError
            self._pidfd = os.pidfd_open(self.vmm_pid)
        except (OSError, ValueError):
            self._end(ENDED, "its VMM ended while diskd was away")
            return
        try:
            self._uffd = native.pidfd_getfd(self._pidfd, _vmm_uffd(self.vmm_pid))
        except OSError as exc:
            raise FeosError(Code.INTERNAL, f"the VMM's userfaultfd not taken back: {exc}") from exc
        self.state = record.get("state", SERVING)
        if self.state == FILLED:
            self.state = SERVING  # a removal since may have made pages missing again
        for region in self.regions:  # faults the previous diskd read and did not resolve
            native.uffd_wake(self._uffd, region.base, region.size)
        log.info("memory %s: took over serving pid %d's memory (%s)", self.id, self.vmm_pid,
                 self.manifest.digest)  # fmt: skip
        self._start(self._serve)

    def _start(self, run: Callable[[], None]) -> None:
        def main() -> None:
            try:
                run()
            except FeosError as exc:
                self.fail(exc.message)
            except Exception as exc:
                log.exception("memory %s: its handler failed", self.id)
                self.fail(f"its handler failed: {exc}")
            finally:
                self._prefetch.shutdown(wait=False, cancel_futures=True)
                self.ended.set()

        self._thread = threading.Thread(target=main, name=f"memory {self.id}", daemon=True)
        self._thread.start()

    def _accept_then_serve(self) -> None:
        listener = self._listener
        assert listener is not None
        ready, _, _ = select.select([listener.fileno(), self._wake_r], [], [], CONNECT_TIMEOUT_S)
        if self._stopping.is_set():
            return
        if listener.fileno() not in ready:
            raise FeosError(Code.DEADLINE_EXCEEDED, f"no VMM connected to {self.socket_path} "
                            f"within {CONNECT_TIMEOUT_S:g}s")  # fmt: skip
        conn, _ = listener.accept()
        with conn:
            self._handshake(conn)
        listener.close()
        self._listener = None
        unlink_quietly(self.socket_path)  # one VMM per server: no one else may connect
        self._serve()

    def _handshake(self, conn: socket.socket) -> None:
        """The VMM's regions and userfaultfd, read from its connection."""
        conn.settimeout(10.0)
        data, fds = b"", []
        while True:
            part, got, _, _ = socket.recv_fds(conn, 65536, 4)
            fds.extend(got)
            data += part
            if not part or len(data) > HANDSHAKE_MAX:
                break
            with contextlib.suppress(ValueError):
                json.loads(data)
                break
        pid = _peer_pid(conn)
        try:
            regions = json.loads(data)
            if not isinstance(regions, list) or not regions or len(fds) != 1:
                raise ValueError("not a list of regions with one userfaultfd beside it")
            self.regions = [Region.from_record(r) for r in regions]
        except (ValueError, FeosError) as exc:
            for fd in fds:
                os.close(fd)
            raise FeosError(Code.INVALID_ARGUMENT, f"the VMM (pid {pid}) sent no Uffd "
                            f"handshake: {exc}") from None  # fmt: skip
        self._uffd = fds[0]
        end = max(r.offset + r.size for r in self.regions)
        if end > self.manifest.size_bytes:
            raise FeosError(Code.FAILED_PRECONDITION, f"the VMM's memory ({end} bytes) is larger "
                            f"than the snapshot {self.manifest.digest} "
                            f"({self.manifest.size_bytes})")  # fmt: skip
        self.vmm_pid, self._vmm_start = pid, _start_time(pid)
        self._pidfd = os.pidfd_open(pid)
        self.state = SERVING
        self._keep()
        log.info("memory %s: serving pid %d's %d regions from %s", self.id, pid,
                 len(self.regions), self.manifest.digest)  # fmt: skip

    # -- serving

    def _serve(self) -> None:
        size = native.uffd_msg_size()
        poller = select.poll()
        poller.register(self._uffd, select.POLLIN)
        poller.register(self._pidfd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping.is_set():
            ready = {fd for fd, _ in poller.poll()}
            if self._uffd in ready:
                try:
                    raw = os.read(self._uffd, size * EVENTS_AT_ONCE)
                except BlockingIOError:
                    raw = b""
                for event, a, b in native.uffd_events(raw):
                    if not self._event(event, a, b):
                        return
                continue  # events first: the VMM's exit is seen once they are served
            if self._pidfd in ready:
                self._end(ENDED, "its VMM ended")
                return

    def _event(self, event: int, a: int, b: int) -> bool:
        """One event served; False when the VMM's memory is gone."""
        lib = self._events
        if event == lib["UFFD_EVENT_PAGEFAULT"]:
            with self._lock:
                self.faults += 1
            offset = self._file_offset(b)
            if offset is None:
                log.warning("memory %s: a fault at %#x is outside every region", self.id, b)
                return True
            alive = self._chunk_in(offset // self.manifest.chunk_size)
            if alive:
                native.uffd_wake(self._uffd, b & ~(PAGE - 1), PAGE)
            return alive
        if event in (lib["UFFD_EVENT_REMOVE"], lib["UFFD_EVENT_UNMAP"]):
            self._remove(a, b)
        else:
            log.warning("memory %s: event %#x not served", self.id, event)
        return True

    def _file_offset(self, address: int) -> int | None:
        for region in self.regions:
            if region.base <= address < region.base + region.size:
                return region.offset + ((address - region.base) & ~(PAGE - 1))
        return None

    def _remove(self, start: int, end: int) -> None:
        """The VMM let [start, end) go: zero pages at their next fault (recorded)."""
        for region in self.regions:
            low, high = max(start, region.base), min(end, region.base + region.size)
            if low < high:
                file_low = region.offset + (low - region.base)
                file_high = region.offset + (high - region.base)
                self._mark_file(file_low, file_high, REMOVED)
                self._removed.append((file_low, file_high))
        self._keep()

    def _mark_file(self, start: int, end: int, state: int) -> None:
        with self._lock:
            first, last = start // PAGE, -(-end // PAGE)
            self._pages[first:last] = bytes([state]) * (last - first)

    def _chunk_in(self, index: int) -> bool:
        """Every page of chunk `index` the VMM lacks copied in; False when its memory is gone."""
        chunk_size = self.manifest.chunk_size
        low, high = index * chunk_size, min((index + 1) * chunk_size, self.manifest.size_bytes)
        data: bytes | None = None
        fetched = False
        for start, end, state in self._runs(low, high):
            if state == MISSING and not fetched:
                data, fetched = self._fetch(index), True
                self._prefetch_after(index)
            source = None if state == REMOVED or data is None else data
            if not self._place(start, end, source, low):
                return False
        return True

    def _runs(self, low: int, high: int) -> Iterator[tuple[int, int, int]]:
        """The runs of file offsets in [low, high) the VMM lacks, each with its state, inside
        one region each."""
        for region in self.regions:
            r_low, r_high = max(low, region.offset), min(high, region.offset + region.size)
            page = r_low // PAGE
            while page * PAGE < r_high:
                with self._lock:
                    state = self._pages[page]
                if state == IN:
                    page += 1
                    continue
                first = page
                with self._lock:
                    while page * PAGE < r_high and self._pages[page] == state:
                        page += 1
                yield first * PAGE, min(page * PAGE, r_high), state

    def _place(self, start: int, end: int, data: bytes | None, chunk_low: int) -> bool:
        """File offsets [start, end) into the VMM (data: the chunk's bytes, None: zeroes)."""
        while start < end:
            address = self._address(start)
            if data is None:
                done, err = native.uffd_zeropage(self._uffd, address, end - start)
            else:
                view = memoryview(data)[start - chunk_low:end - chunk_low]
                done, err = native.uffd_copy(self._uffd, address, view)
            placed_end = start + done
            if err == errno.EEXIST:
                placed_end = start + done + PAGE  # that page was there: skip it
            with self._lock:
                first, last = start // PAGE, min(placed_end, end) // PAGE
                copied = self._pages[first:first + done // PAGE]
                self.pages_in += len(copied) - copied.count(IN)
                self._pages[first:last] = bytes([IN]) * (last - first)
            if err in native.UFFD_GONE:
                self._end(ENDED, "its VMM's memory went away")
                return False
            start = min(placed_end, end)
        return True

    def _address(self, file_offset: int) -> int:
        for region in self.regions:
            if region.offset <= file_offset < region.offset + region.size:
                return region.base + file_offset - region.offset
        raise AssertionError(f"file offset {file_offset} outside the regions")

    def _fetch(self, index: int) -> bytes | None:
        """Chunk `index`, checked; after FETCH_ROUNDS failed rounds the VMM is failed."""
        ahead = self._prefetched.get(index)
        if ahead is not None:
            concurrent.futures.wait([ahead])  # its fetch in flight: then the cache has it
        for attempt in range(FETCH_ROUNDS):
            try:
                if self._store is None:
                    raise FeosError(Code.FAILED_PRECONDITION, "diskd has no object store")
                return self._store.memory_chunk(self.manifest, index, self._cache)
            except FeosError as exc:
                if attempt + 1 == FETCH_ROUNDS:
                    raise FeosError(exc.code, f"chunk {index} of {self.manifest.what} could not "
                                    f"be had: {exc.message}") from None  # fmt: skip
                log.warning("memory %s: chunk %d: %s (round %d of %d)", self.id, index,
                            exc.message, attempt + 1, FETCH_ROUNDS)  # fmt: skip
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _prefetch_after(self, index: int) -> None:
        for ahead in range(index + 1, min(index + 1 + PREFETCH, len(self.manifest.chunks))):
            hex_ = self.manifest.chunks[ahead]
            if hex_ is None or ahead in self._prefetched or hex_ in self._cache:
                continue
            with contextlib.suppress(RuntimeError):  # shut down: the server ends
                self._prefetched[ahead] = self._prefetch.submit(self._quiet_fetch, ahead)

    def _quiet_fetch(self, index: int) -> None:
        try:
            if self._store is not None:
                self._store.memory_chunk(self.manifest, index, self._cache)
        except FeosError as exc:  # the fault that needs it fetches it again, and says so
            log.info("memory %s: prefetch of chunk %d: %s", self.id, index, exc.message)

    # -- the API's calls, from other threads

    def fill(self) -> None:
        """Every page the VMM still lacks copied in (after it, a suspend reads no page through
        the handler). FAILED_PRECONDITION while no VMM is connected or after the end."""
        if self.state not in (SERVING, FILLED) or self._uffd < 0:
            raise FeosError(Code.FAILED_PRECONDITION, f"memory {self.id} is {self.state}"
                            f"{': ' + self.reason if self.reason else ''}: nothing to fill")
        for index in range(len(self.manifest.chunks)):
            if self._stopping.is_set() or self.ended.is_set():
                raise FeosError(Code.ABORTED, f"memory {self.id}: {self.state} while filling")
            try:
                alive = self._chunk_in(index)
            except FeosError as exc:
                self.fail(exc.message)
                raise
            if not alive:
                raise FeosError(Code.ABORTED, f"memory {self.id}: {self.reason}")
        with self._lock:
            whole = all(p != MISSING for p in self._pages_of_regions())
        if whole and self.state == SERVING:
            self.state = FILLED
            self._keep()
        log.info("memory %s: filled (%d pages copied in so far)", self.id, self.pages_in)

    def _pages_of_regions(self) -> Iterator[int]:
        for region in self.regions:
            yield from self._pages[region.offset // PAGE:(region.offset + region.size) // PAGE]

    def answer(self) -> dict[str, Any]:
        total = sum(r.size for r in self.regions) // PAGE
        return {"id": self.id, "digest": self.manifest.digest, "socket": str(self.socket_path),
                "state": self.state, "reason": self.reason, "vmmPid": self.vmm_pid,
                "sizeBytes": self.manifest.size_bytes, "pagesIn": self.pages_in,
                "pagesTotal": total, "faults": self.faults,
                "recovered": self.recovered}  # fmt: skip

    def restore_failed(self, record: dict[str, Any], reason: str, kill: bool = True) -> None:
        """A server of the diskd before that cannot serve on: its VMM, if it still runs,
        killed, and the reason kept."""
        self.vmm_pid = int(record.get("vmm_pid", 0))
        self._vmm_start = int(record.get("vmm_start", 0))
        self.recovered = True
        if kill and self.vmm_pid:
            with contextlib.suppress(OSError, ValueError):
                if _start_time(self.vmm_pid) == self._vmm_start:
                    self._pidfd = os.pidfd_open(self.vmm_pid)
        if kill:
            self.fail(reason)
        else:
            self.state, self.reason = FAILED, reason
        self.ended.set()

    def fail(self, reason: str) -> None:
        """The VMM killed (its vCPUs would wait for pages no one copies) and why kept."""
        if self.state in (ENDED, FAILED):
            return
        log.error("memory %s: failed: %s", self.id, reason)
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._end(FAILED, f"its memory could not be served, so its VMM was killed: {reason}")

    def stop(self) -> None:
        """Serving ends (the VMM ended, or is to be ended by its owner); the record goes."""
        self._stopping.set()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._close()
        unlink_quietly(self._record_path)

    def _end(self, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        log.info("memory %s: %s: %s", self.id, state, reason)
        self._close()
        if state == FAILED:
            self._keep()  # why, for feosd to read after its VMM's end
        else:
            unlink_quietly(self._record_path)

    def _close(self) -> None:
        for name in ("_uffd", "_pidfd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            unlink_quietly(self.socket_path)

    def _keep(self) -> None:
        write_json(self._record_path, {
            "id": self.id, "digest": self.manifest.digest, "socket": str(self.socket_path),
            "state": self.state, "reason": self.reason, "vmm_pid": self.vmm_pid,
            "vmm_start": self._vmm_start, "regions": [r.record() for r in self.regions],
            "removed": [list(r) for r in self._removed], "owner_uid": self.owner_uid,
        })  # fmt: skip


class LazyMemory:
    """diskd's memory servers by pod: serveMemory, fillMemory, getMemoryServer, stopMemory, and
    their recovery at diskd's start."""

    def __init__(self, directory: Path, store: Callable[[], ObjectStore], cache: ChunkCache
                 ) -> None:  # fmt: skip
        self.directory = directory  # DIR/memory: a record per server
        self._store = store  # the store, or FAILED_PRECONDITION saying why there is none
        self._cache = cache
        self.servers: dict[str, MemoryServer] = {}
        self._lock = threading.Lock()

    def _new(self, server_id: str, manifest: MemoryManifest, socket_path: Path
             ) -> MemoryServer:  # fmt: skip
        return MemoryServer(server_id, manifest, socket_path, self.directory / f"{server_id}.json",
                            self._store(), self._cache)  # fmt: skip

    def serve(self, server_id: str, digest: str, socket_path: Path, owner_uid: int
              ) -> MemoryServer:  # fmt: skip
        """Blocks (the manifest's fetch): a worker thread's."""
        with self._lock:
            found = self.servers.get(server_id)
            if found is not None and found.state in (LISTENING, SERVING, FILLED):
                if (found.manifest.digest, found.socket_path) != (digest, socket_path):
                    raise FeosError(Code.ALREADY_EXISTS, f"memory {server_id} is served from "
                                    f"{found.manifest.digest} on {found.socket_path}")
                return found
        manifest = self._store().get_memory(digest)
        self.directory.mkdir(parents=True, exist_ok=True)
        server = self._new(server_id, manifest, socket_path)
        server.listen(owner_uid)
        with self._lock:
            self.servers[server_id] = server
        return server

    def get(self, server_id: str) -> MemoryServer:
        server = self.servers.get(server_id)
        if server is None:
            raise FeosError(Code.NOT_FOUND, f"diskd serves no memory of {server_id}")
        return server

    def stop(self, server_id: str) -> None:
        server = self.get(server_id)
        server.stop()
        with self._lock:
            self.servers.pop(server_id, None)

    def recover(self) -> None:
        """The servers of the diskd before, from their records: each serves on, or its VMM is
        failed with the reason (blocks: a worker thread's)."""
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("*.json")):
            try:
                record = json.loads(path.read_bytes())
                server_id, digest = str(record["id"]), str(record["digest"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("memory record %s unreadable (%s): removed", path, exc)
                unlink_quietly(path)
                continue
            self._recover_one(server_id, digest, record)

    def _recover_one(self, server_id: str, digest: str, record: dict[str, Any]) -> None:
        socket_path = Path(str(record.get("socket", "")))
        manifest = MemoryManifest(digest=digest, size_bytes=0)
        try:
            manifest = self._store().get_memory(digest)
            server = self._new(server_id, manifest, socket_path)
        except FeosError as exc:
            server = MemoryServer(server_id, manifest, socket_path,
                                  self.directory / f"{server_id}.json", None, self._cache)
            server.restore_failed(record, f"its snapshot could not be had after diskd's "
                                  f"restart: {exc.message}")  # fmt: skip
            self.servers[server_id] = server
            return
        self.servers[server_id] = server
        state = record.get("state")
        try:
            if state == FAILED:
                server.restore_failed(record, str(record.get("reason", "")), kill=False)
            elif state == LISTENING:
                server.listen(int(record.get("owner_uid", 0)))
            else:
                server.adopt(record)
        except (FeosError, OSError) as exc:
            message = exc.message if isinstance(exc, FeosError) else str(exc)
            server.restore_failed(record, f"not taken over after diskd's restart: {message}")
