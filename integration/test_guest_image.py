"""The guest image: hack/guest-image builds (or reuses) it, and it boots under QEMU microvm.

The build goes into the default prefix (/usr/lib/feos/guest), so the whole suite pays for it once
per machine; every later run reuses the installed version with the same inputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from guestvm import Guest, GuestVM, Qmp, unpack_data

REPO = Path(__file__).resolve().parent.parent


def _build() -> str:
    out = subprocess.run([str(REPO / "hack/guest-image")], check=True, text=True,
                         stdout=subprocess.PIPE, timeout=1200).stdout  # fmt: skip
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def guest() -> Guest:
    return Guest.at(_build())


def _has_agent(guest: Guest) -> bool:
    agent = guest.manifest["inputs"]["agent"]  # type: ignore[index]
    return "feos/guest/__main__.py" in agent  # type: ignore[operator]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def test_installed_files_match_the_manifest(guest: Guest) -> None:
    assert guest.dir.name == guest.version
    assert len(guest.version) == 12
    assert str(guest.manifest["kernel"]).endswith("-amd64")
    files = guest.manifest["files"]
    assert isinstance(files, dict)
    assert sorted(files) == ["data.img.zst", "initramfs", "root.erofs", "vmlinux", "vmlinuz"]
    for name, digest in files.items():
        assert _sha256(guest.dir / name) == digest, name
    assert (guest.dir / "vmlinux").read_bytes()[:4] == b"\x7fELF"
    assert (guest.dir / "initramfs").read_bytes()[:6] == b"070701"  # newc cpio
    with (guest.dir / "root.erofs").open("rb") as f:
        f.seek(1024)
        assert f.read(4) == (0xE0F5E1E2).to_bytes(4, "little")  # the erofs superblock magic


def test_blank_data_volume_is_sparse_ext4(guest: Guest, tmp_path: Path) -> None:
    img = unpack_data(guest, tmp_path / "data.img")
    st = img.stat()
    assert st.st_size == 8 << 30
    assert st.st_blocks * 512 < 64 << 20  # sparse: a few MiB of metadata, the rest holes
    with img.open("rb") as f:
        f.seek(1024 + 56)
        assert f.read(2) == b"\x53\xef"  # the ext4 superblock magic


def test_same_inputs_reuse_the_installed_version(guest: Guest) -> None:
    # Built again first: feos/guest/ may have changed since the fixture's build (its engineer
    # works beside this suite), and then the version does too.
    first = _build()
    t = time.monotonic()
    assert _build() == first
    assert time.monotonic() - t < 15  # no build: one apt-cache call and the hashes


@pytest.fixture(scope="module")
def shell_floor(guest: Guest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuestVM]:
    with GuestVM.boot(guest, tmp_path_factory.mktemp("shell"), floor="shell", timeout=90) as vm:
        vm.wait_exit(90)
        yield vm


def test_shell_floor_prints_its_marker_and_powers_off(shell_floor: GuestVM) -> None:
    assert "FEOS-FLOOR-SHELL" in shell_floor.console()
    assert shell_floor.proc.returncode == 0


@pytest.fixture(scope="module")
def python_floor(guest: Guest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuestVM]:
    with GuestVM.boot(guest, tmp_path_factory.mktemp("python"), floor="python", timeout=90) as vm:
        vm.wait_exit(90)
        yield vm


def test_python_floor_runs_the_roots_python(python_floor: GuestVM) -> None:
    console = python_floor.console()
    assert "FEOS-FLOOR-PYTHON" in console
    assert "FEOS-FLOOR-SHELL" not in console
    assert python_floor.proc.returncode == 0


def test_python_floor_mounted_the_data_disk(python_floor: GuestVM) -> None:
    assert "FEOS-INIT: data disk /dev/vdb at /data" in python_floor.console()


def test_boot_starts_the_agent_or_says_it_has_none(guest: Guest, tmp_path: Path) -> None:
    with GuestVM.boot(guest, tmp_path, timeout=120) as vm:
        if not _has_agent(guest):
            # feos/guest/ had no __main__.py when this version was built: /init says so and
            # powers off rather than hang.
            vm.wait_console("FEOS-INIT-NO-AGENT", 90)
            assert vm.wait_exit(30) == 0
            return
        vm.wait_console("FEOS-INIT: starting the agent", 90)
        sock = vm.connect_link(10)
        with sock:
            hello = vm.read_line(sock, 60)
        words = hello.split()
        assert words[:2] == [b"FEOS-GUEST", b"1"], hello
        assert len(words) == 4, hello


LEAN_PROBE = b"""
import sys
import feos.guest.__main__  # as the launcher imports it
from feos.guest import _lean
print("PROBE ssl", "ssl" in sys.modules)
print("PROBE pending", ",".join(sorted(_lean.pending())))
import http.client
print("PROBE https", hasattr(http.client, "HTTPSConnection"))
"""


def test_script_floor_runs_a_program_and_the_agent_starts_lean_in_the_guest(
    guest: Guest, tmp_path: Path
) -> None:
    """The guest's own python3 (Debian's 3.11.2) imports the agent without ssl, its lazy
    modules waiting, and https still there after (bench/guest_boot.py --imports uses this floor).
    """
    program = tmp_path / "program.img"
    program.write_bytes(LEAN_PROBE + b"\0" * (-len(LEAN_PROBE) % 512))
    with GuestVM.boot(guest, tmp_path, floor="script", volumes=[program], timeout=120) as vm:
        vm.wait_console("FEOS-SCRIPT-END", 110)
        console = vm.console()
        assert vm.wait_exit(30) == 0
    if "FEOS-SCRIPT-STDERR" not in console:
        pytest.fail(f"no script floor in this image: {console[-2000:]}")
    lines = dict(
        line.removeprefix("PROBE ").split(" ", 1)
        for line in console.splitlines()
        if line.startswith("PROBE ")
    )
    if "feos/guest/_lean.py" not in guest.manifest["inputs"]["agent"]:  # type: ignore[index,operator]
        pytest.fail("this image's agent has no _lean.py: built from an older tree")
    from feos.guest import _lean

    assert lines == {"ssl": "False", "pending": ",".join(sorted(_lean.LAZY)), "https": "True"}
    stderr = console.partition("FEOS-SCRIPT-STDERR")[2]
    assert "import time:" in stderr and "asyncio.base_events" in stderr


def test_sandboxed_qemu_as_another_user_boots(guest: Guest, tmp_path: Path) -> None:
    vm = GuestVM.boot(guest, tmp_path, floor="shell", data=False, timeout=90)
    vm.kill()  # only its config was wanted: the same boot, sandboxed and as nobody
    with GuestVM(attrs.evolve(vm.config, sandbox=True, runas="nobody"), tmp_path, 90) as boxed:
        assert boxed.wait_exit(90) == 0
        assert "FEOS-FLOOR-SHELL" in boxed.console()


async def _ping(path: Path) -> str:
    import capnp

    from feos.guestlink import GuestClient

    async with capnp.kj_loop():
        client = await GuestClient.connect(str(path), deadline=60)
        try:
            return (await client.ping()).boot_id
        finally:
            await client.close()


def _migrated(qmp: Qmp) -> None:
    for _ in range(600):
        status = qmp.execute("query-migrate")
        assert isinstance(status, dict)
        if status.get("status") == "completed":
            return
        assert status.get("status") in ("setup", "active", "device", None), status
        time.sleep(0.05)
    raise AssertionError("the migration to a file did not complete in 30 s")


def test_suspend_to_a_file_and_resume_with_incoming(guest: Guest, tmp_path: Path) -> None:
    assert _has_agent(guest), "this version has no agent to ping (feos/guest/__main__.py)"
    snap = tmp_path / "memory"
    with GuestVM.boot(guest, tmp_path / "a", timeout=120) as vm:
        boot_id = asyncio.run(_ping(vm.wait_link()))
        qmp = vm.qmp()
        qmp.execute("stop")
        qmp.execute("migrate-set-parameters", **{"max-bandwidth": 4 << 30})
        qmp.execute("migrate", uri=f"exec:cat > {snap}")
        _migrated(qmp)
        qmp.close()
    b = tmp_path / "b"
    b.mkdir()
    resumed = attrs.evolve(vm.config, incoming=str(snap), link_socket=str(b / "guest.sock"),
                           qmp_socket=str(b / "qmp.sock"), serial_log=str(b / "serial.log"))  # fmt: skip
    with GuestVM(resumed, b, 60) as vm2:
        qmp = vm2.qmp()
        for _ in range(600):  # "inmigrate" until the file is read, then "paused"
            status = qmp.execute("query-status")
            assert isinstance(status, dict)
            if status.get("status") == "paused":
                break
            time.sleep(0.05)
        qmp.execute("cont")
        qmp.close()
        # The same boot, answering on a new session over the resumed virtio-serial port.
        assert asyncio.run(_ping(vm2.wait_link())) == boot_id
