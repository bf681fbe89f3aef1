"""The serial console's reader (feos.vmm._console.SerialLog): what is there, then what comes."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from feos.vmm._console import SerialLog, serial_log_path


def test_the_drivers_paths(tmp_path: Path) -> None:
    assert serial_log_path(tmp_path, "qemu", "pa00000001a") == \
        tmp_path / "vms/qemu/pa00000001a/serial.log"
    assert serial_log_path(tmp_path, "firecracker", "pa00000001a").name == "serial.log"


async def test_read_to_the_end_without_follow(tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    log.write_bytes(b"[0.0] Linux version\n")
    stream = SerialLog(log, follow=False)
    assert await stream.read({}) == {"stdout": b"[0.0] Linux version\n", "stderr": b""}
    assert (await stream.read({}))["exited"] is True


async def test_follow_reads_what_comes_until_the_vm_stops(tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    log.write_bytes(b"one\n")
    running = [True]
    stream = SerialLog(log, follow=True, alive=lambda: running[0])
    assert (await stream.read({}))["stdout"] == b"one\n"
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:

        async def reader() -> None:
            got.append((await stream.read({}))["stdout"])

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        with log.open("ab") as out:  # the VMM appends (a rewrite would read as a boot's truncation)
            out.write(b"two\n")
    assert got == [b"two\n"]
    running[0] = False
    assert (await stream.read({}))["exited"] is True


async def test_a_boot_truncates_and_the_reader_starts_again(tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    log.write_bytes(b"the first boot, long\n")
    stream = SerialLog(log, follow=False)
    await stream.read({})
    log.write_bytes(b"second\n")
    assert (await stream.read({}))["stdout"] == b"second\n"
