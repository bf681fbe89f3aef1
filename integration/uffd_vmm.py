"""A process that hands its memory to a page fault handler as Firecracker's Uffd backend does.

    python uffd_vmm.py SOCKET SIZE [SIZE ...]

maps anonymous memory regions of the sizes given (bytes, page multiples), makes a userfaultfd
with UFFD_FEATURE_EVENT_REMOVE, registers every region, connects to SOCKET and sends the
regions as Firecracker's GuestRegionUffdMapping JSON with the userfaultfd beside it, keeping the
connection open (as Firecracker does) and its own copy of the fd. Then it reads commands on
stdin, one a line, and answers each on stdout:

    read OFFSET LENGTH     -> the sha256 hex of those bytes of the snapshot file's layout
    remove OFFSET LENGTH   -> "ok" once madvise(MADV_DONTNEED) returned (UFFD_EVENT_REMOVE)

Not a stand-in for Firecracker in what a test asserts of Firecracker; it is the VMM side of the
protocol for diskd's handler's own tests (the Firecracker test boots the real one). Run with
integration/ and the source tree on sys.path.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import socket
import sys

from feos import native


def main(argv: list[str]) -> None:
    path, sizes = argv[0], [int(a) for a in argv[1:]]
    regions = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for size in sizes]
    consts = native.uffd_constants()
    uffd = native.uffd_open()
    native.uffd_api(uffd, consts["UFFD_FEATURE_EVENT_REMOVE"])
    mappings, offset = [], 0
    for region, size in zip(regions, sizes, strict=True):
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        native.uffd_register(uffd, base, size)
        mappings.append({"base_host_virt_addr": base, "size": size, "offset": offset,
                         "page_size": 4096, "page_size_kib": 4096})  # fmt: skip
        offset += size
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(mappings).encode()], [uffd])
    print("ready", flush=True)
    for line in sys.stdin:
        verb, start, length = line.split()
        at, n = int(start), int(length)
        i, base_offset = _region(mappings, at)
        region = regions[i]
        if verb == "read":
            print(hashlib.sha256(region[at - base_offset:at - base_offset + n]).hexdigest(),
                  flush=True)  # fmt: skip
        elif verb == "remove":
            region.madvise(mmap.MADV_DONTNEED, at - base_offset, n)
            print("ok", flush=True)
    conn.close()
    os.close(uffd)


def _region(mappings: list[dict[str, int]], at: int) -> tuple[int, int]:
    for i, m in enumerate(mappings):
        if m["offset"] <= at < m["offset"] + m["size"]:
            return i, m["offset"]
    raise SystemExit(f"offset {at} is outside the regions")


if __name__ == "__main__":
    main(sys.argv[1:])
