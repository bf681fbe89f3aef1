"""feos.native, the typed face of feos._native: each call against the kernel, and the datagram
batch against Python's own socket path over loopback UDP (any datagrams, any answers, the
answers' bytes dropped and their memory reused before the flush)."""

from __future__ import annotations

import errno
import gc
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feos import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="feos._native is not built: python native/build.py"
)


# --- files and processes ---------------------------------------------------------------------


def test_flock_is_exclusive_between_open_files_and_let_go(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    first = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    second = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        assert native.flock(first, wait=False)
        assert not native.flock(second, wait=False)
        assert not native.flock(second, exclusive=False, wait=False)
        native.unlock(first)
        assert native.flock(second, exclusive=False, wait=False)
        assert native.flock(first, exclusive=False, wait=False)  # shared with shared
    finally:
        os.close(first)
        os.close(second)


def test_a_failed_call_is_oserror_with_its_errno_and_name() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)  # a descriptor that is no longer open
    with pytest.raises(OSError, match="flock") as caught:
        native.flock(r, wait=False)
    assert caught.value.errno == errno.EBADF
    with pytest.raises(OSError, match="setns") as caught:
        native.setns(r)
    assert caught.value.errno == errno.EBADF
    with pytest.raises(OSError, match="fallocate") as caught:
        native.punch_hole(r, 0, 4096)
    assert caught.value.errno == errno.EBADF


def test_set_child_subreaper_in_a_process_of_its_own() -> None:
    code = (
        "from feos import native\n"
        "before = native.is_child_subreaper()\n"
        "native.set_child_subreaper()\n"
        "print(before, native.is_child_subreaper())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_punch_hole_reads_zeros_and_keeps_the_size(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    path.write_bytes(b"\xab" * (4 * 4096))
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            native.punch_hole(fd, 4096, 8192)
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                pytest.skip(f"{tmp_path}'s file system cannot punch holes")
            raise
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data == b"\xab" * 4096 + bytes(8192) + b"\xab" * 4096


# --- the datagram batch ----------------------------------------------------------------------


@pytest.fixture
def udp() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A server socket and three clients, on loopback addresses of their own."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        server.bind(("127.0.0.1", 0))
        server.setblocking(False)
        for n, c in enumerate(clients):
            c.bind((f"127.0.0.{n + 2}", 0))
            c.settimeout(5)
        yield server, clients
    finally:
        for s in (server, *clients):
            s.close()


def churn(size: int, count: int = 2000) -> list[bytes]:
    """Freed memory taken again and overwritten: bytes of about the size just let go."""
    gc.collect()
    return [bytes([n % 251 + 1]) * size for n in range(count)]


datagrams = st.lists(
    st.tuples(st.integers(0, 2), st.binary(max_size=600) | st.sampled_from([b"", b"\x01"])),
    min_size=1,
    max_size=native.BATCH_MAX,
)


def test_a_batch_delivers_what_recvfrom_and_sendto_deliver(
    udp: tuple[socket.socket, list[socket.socket]],
) -> None:
    # The batch's answers, their bytes dropped and their memory reused before the flush,
    # against the plain path's on the same datagrams: each client gets the same, in order.
    server, clients = udp
    batch = native.DatagramBatch(server.fileno())
    plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    plain.bind(("127.0.0.1", 0))
    plain.setblocking(False)

    def answer(data: bytes, n: int) -> bytes:
        return bytes(reversed(data)) + b"#%d" % n * (n % 5)  # made here, dropped after

    def batch_side(sent: list[tuple[int, bytes]]) -> list[list[bytes]]:
        for c, data in sent:
            clients[c].sendto(data, server.getsockname())
        assert batch.read() == len(sent)
        for n, (c, data) in enumerate(sent):
            assert batch.datagram(n) == data
            assert batch.peer(n) == clients[c].getsockname()
            assert batch.addrs[n] == int.from_bytes(socket.inet_aton(f"127.0.0.{c + 2}"), "little")
            if len(data) >= 2 and n % 2:
                assert batch.reply(n, answer(data[2:], n))
            else:
                assert batch.queue(n, answer(data, n))
        kept = churn(700)
        assert batch.flush() == 0
        del kept
        return received(sent)

    def plain_side(sent: list[tuple[int, bytes]]) -> list[list[bytes]]:
        for c, data in sent:
            clients[c].sendto(data, plain.getsockname())
        for n in range(len(sent)):
            data, peer = plain.recvfrom(65535)
            wire = data[:2] + answer(data[2:], n) if len(data) >= 2 and n % 2 else answer(data, n)
            plain.sendto(wire, peer)
        return received(sent)

    def received(sent: list[tuple[int, bytes]]) -> list[list[bytes]]:
        return [[clients[c].recv(65535) for c2, _ in sent if c2 == c] for c in range(3)]

    @settings(max_examples=60, deadline=None)
    @given(datagrams)
    def check(sent: list[tuple[int, bytes]]) -> None:
        assert batch_side(sent) == plain_side(sent)

    with plain:
        check()


def test_the_largest_datagram_in_and_out_and_one_too_long(
    udp: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = udp
    batch = native.DatagramBatch(server.fileno(), 4)
    assert batch.read() == 0  # nothing waits
    big = bytes(range(256)) * 255 + b"\x07" * 227  # 65507: the most one IPv4 datagram carries
    clients[0].sendto(big, server.getsockname())
    assert batch.read() == 1
    assert batch.datagram(0) == big
    assert not batch.queue(0, b"x" * (native.SLOT + 1))  # more than a datagram holds
    assert not batch.reply(0, b"x" * (native.SLOT - 1))
    assert batch.queue(0, big[::-1])
    assert batch.flush() == 2  # the two refused: counted once, at the flush
    assert clients[0].recv(65535) == big[::-1]
    assert batch.flush() == 0


def test_an_answer_goes_where_its_query_came_from_even_after_a_later_read(
    udp: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = udp
    batch = native.DatagramBatch(server.fileno())
    clients[0].sendto(b"from zero", server.getsockname())
    assert batch.read() == 1
    assert batch.queue(0, b"to zero")
    clients[1].sendto(b"from one", server.getsockname())
    assert batch.read() == 1  # datagram 0 is now client 1's
    assert batch.queue(0, b"to one")
    assert batch.flush() == 0
    assert clients[0].recv(100) == b"to zero"
    assert clients[1].recv(100) == b"to one"


def test_indexes_and_sizes_out_of_bounds_are_refused(
    udp: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = udp
    for size in (0, native.BATCH_MAX + 1):
        with pytest.raises(OSError, match="batch") as caught:
            native.DatagramBatch(server.fileno(), size)
        assert caught.value.errno == errno.EINVAL
    batch = native.DatagramBatch(server.fileno(), 2)
    clients[0].sendto(b"\x01", server.getsockname())
    assert batch.read() == 1
    for i in (1, 2, native.BATCH_MAX, 2**31):  # no such datagram in this read
        with pytest.raises(OSError, match="queue an answer") as caught:
            batch.queue(i, b"answer")
        assert caught.value.errno == errno.EINVAL
        with pytest.raises(IndexError):
            batch.datagram(i)
    with pytest.raises(OSError, match="queue an answer") as caught:
        batch.reply(0, b"answer")  # a datagram of 1 byte has no 2-byte ID to send back
    assert caught.value.errno == errno.EINVAL
    assert batch.queue(0, b"a") and batch.queue(0, b"b")
    with pytest.raises(OSError, match="queue an answer") as caught:
        batch.queue(0, b"c")  # a batch of 2 holds 2 answers
    assert caught.value.errno == errno.ENOBUFS
    assert batch.flush() == 0
    assert [clients[0].recv(10) for _ in range(2)] == [b"a", b"b"]


def test_views_of_a_batch_keep_its_memory_after_the_batch_is_dropped(
    udp: tuple[socket.socket, list[socket.socket]],
) -> None:
    server, clients = udp
    batch = native.DatagramBatch(server.fileno())
    clients[2].sendto(b"kept", server.getsockname())
    assert batch.read() == 1
    data, lengths, addrs, at = batch.data, batch.lengths, batch.addrs, batch.data_at
    del batch
    kept = churn(9 << 20, 4)  # blocks the size of the batch's, were it freed: taken again
    assert lengths[0] == 4 and addrs[0] == int.from_bytes(bytes([127, 0, 0, 4]), "little")
    assert data[at : at + 4] == b"kept"
    del kept


# --- records -----------------------------------------------------------------------------------


def test_a_group_commit_applies_in_order_and_names_each_failure(tmp_path: Path) -> None:
    (tmp_path / "old.pb").write_bytes(b"old")
    (tmp_path / ".blocked.tmp").mkdir()  # a put whose temporary file cannot be made
    (tmp_path / "full.pb").mkdir()  # a put that cannot be renamed over its record
    (tmp_path / "full.pb" / "x").write_bytes(b"")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        errors, dir_error = native.commit_group(dir_fd, [
            (".a.1.tmp", "a.pb", b"first"),
            (".a.2.tmp", "a.pb", b"second"),  # the same record again: the later one stays
            ("", "old.pb", None),
            ("", "never.pb", None),  # a removal of what is not there is no failure
            (".blocked.tmp", "b.pb", b"b"),
            (".full.tmp", "full.pb", b"f"),
            (".c.tmp", "c.pb", b"c" * 100_000),
        ])  # fmt: skip
    finally:
        os.close(dir_fd)
    assert errors[:4] == [0, 0, 0, 0] and errors[6] == 0
    assert errors[4] == errno.EISDIR
    assert errors[5] in (errno.EISDIR, errno.ENOTEMPTY)
    assert dir_error == 0
    assert (tmp_path / "a.pb").read_bytes() == b"second"
    assert (tmp_path / "c.pb").read_bytes() == b"c" * 100_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".blocked.tmp", "a.pb", "c.pb", "full.pb"
    ]  # the failed put's temporary file removed, the removed record gone  # fmt: skip


def test_a_group_commit_on_a_closed_directory_fails_every_change() -> None:
    dir_fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    os.close(dir_fd)
    errors, dir_error = native.commit_group(dir_fd, [(".x.tmp", "x.pb", b"x"), ("", "y.pb", None)])
    assert errors == [errno.EBADF, errno.EBADF]
    assert dir_error == 0  # nothing was applied: nothing to sync


def test_a_group_commit_larger_than_the_files_it_opens_at_once(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        changes = [(f".r{i}.tmp", f"r{i}.pb", str(i).encode()) for i in range(150)]
        changes[100] = (".r100.tmp", "r99.pb", b"again")  # a later put of a record wins
        errors, dir_error = native.commit_group(dir_fd, changes)
    finally:
        os.close(dir_fd)
    assert errors == [0] * 150 and dir_error == 0
    assert len(list(tmp_path.iterdir())) == 149
    assert (tmp_path / "r99.pb").read_bytes() == b"again"
    assert (tmp_path / "r149.pb").read_bytes() == b"149"
