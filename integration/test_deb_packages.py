"""feos's Debian packages installed from a signed local apt repository into a fresh Debian root
that runs systemd as its PID 1 (systemd-nspawn --boot), for Debian 12 and Debian 13.

Two builds of the work tree are published into a repository signed by a test key (made for the
session, thrown away after), then in each distribution's root: the install enables and starts
feosd.socket, diskd and feosd; feosd serves its API; a DNS query sent while feosd is stopped
waits in feosd.socket and starts feosd; a bad option in /etc/default/feosd fails the unit with
feosd's own error; a disk diskd serves outlives `systemctl restart diskd` and the upgrade to the
second build; a feosd from before the socket is stopped before the socket takes the address;
remove stops the units and purge disables them, /var/lib/feos staying. Debian 13's root runs
only the tests whose behaviour differs there (see BOTH): its systemd, Python, QEMU and apt.

A pod runs in the root: a QEMU microVM under TCG without containers or a network (a
container's image comes from a registry, which the root, on a private network, cannot reach);
it outlives `systemctl restart feosd` and the upgrade, taken over by the next feosd. The
container's cgroup v1 hierarchies are read-only (systemd-nspawn mounts them so on this hybrid
host): feosd runs the microVMs there without cgroups of their own and says so.
"""

from __future__ import annotations

import calendar
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from debroot import Container, booted

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SUITES = {"bookworm": "oldstable", "trixie": "stable"}
OLD, NEW = "0.1.0~dev.1", "0.1.0~dev.2"
PY = "python3 -I -c 'import sys; sys.path.insert(0, \"/usr/lib/feos/python\"); exec(sys.stdin.read())'"


def _build(out: Path, version: str, guest: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "packaging/deb/build.py"), "--out", str(out),
                    "--version", version, "--guest-dir", str(guest)], check=True,
                   stdout=subprocess.DEVNULL)


def _guest_image() -> Path:
    """The work tree's guest version, as hack/guest-image builds or finds it."""
    out = subprocess.run([str(REPO / "hack/guest-image"), "--keep-all"], check=True, text=True,
                         stdout=subprocess.PIPE).stdout
    return Path(out.strip().splitlines()[-1])


def _newer_guest(guest: Path, top: Path) -> Path:
    """The same image as a newer guest version (its own name, built a day later), so that the
    second build's feos-guest depends on another feos-guest-<version>."""
    manifest = json.loads((guest / "manifest.json").read_text())
    first = "e" if manifest["version"].startswith("f") else "f"  # never the same name
    newer = top / "guest" / (first + manifest["version"][1:])
    newer.mkdir(parents=True)
    for f in guest.iterdir():
        if f.name != "manifest.json":
            (newer / f.name).hardlink_to(f)
    built = time.strptime(manifest["built"].replace("+00:00", ""), "%Y-%m-%dT%H:%M:%S")
    later = time.gmtime(calendar.timegm(built) + 86400)
    manifest.update(version=newer.name, built=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", later))
    (newer / "manifest.json").write_text(json.dumps(manifest))
    return newer


def _publish(repo: Path, key: Path, build: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "packaging/deb/repo.py"), "--repo", str(repo),
                    "--gnupg-home", str(key), str(build)], check=True, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two builds of the work tree, the second one newer; the first one published."""
    top = tmp_path_factory.mktemp("debs")
    guest = _guest_image()
    newer = _newer_guest(guest, top)
    out = {OLD: top / "old", NEW: top / "new"}
    _build(out[OLD], OLD, guest)
    _build(out[NEW], NEW, newer)
    repo, key = top / "apt", top / "apt.key"
    _publish(repo, key, out[OLD])
    return {"repo": repo, "key": key, "guest": guest, "newer": newer, **out}


def _old_guest_build(builds: dict[str, Path], codename: str) -> str:
    """The first build's feos-guest version (the meta package's), from its .deb's name."""
    deb = next((builds[OLD] / codename).glob("feos-guest_*.deb"))
    return deb.name.split("_")[1]


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest, builds: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """The distribution's root (the test's parameter) with the first build installed."""
    codename = request.param
    work = tmp_path_factory.mktemp(f"root-{codename}")
    with booted(codename, work / "c", binds={"/srv/feos-apt": builds["repo"]}) as c:
        c.sh(f"echo 'deb [signed-by=/srv/feos-apt/feos.gpg] file:/srv/feos-apt "
             f"{SUITES[codename]} main' > /etc/apt/sources.list.d/feos.list && apt-get update -q")
        tag = {"bookworm": "deb12", "trixie": "deb13"}[codename]
        pinned = " ".join(f"{p}={OLD}+{tag}" for p in ("feosd", "feosctl", "diskd", "feos-python"))
        # the first build's guest too: the other root's upgrade may have published the second
        # one already, whose feos-guest would otherwise come with the first feosd (its
        # dependency is >=); then marked automatic, as a dependency of feosd's
        guest = _old_guest_build(builds, codename)
        install = c.sh(f"apt-get install -y -q {pinned} feos-guest={guest} && "
                       "apt-mark auto feos-guest")
        old_guest = f"feos-guest-{builds['guest'].name}"
        assert c.sh(f"dpkg-query -W -f '${{Status}}' {old_guest}").stdout == "install ok installed"
        c.codename = codename  # type: ignore[attr-defined]
        c.install_log = install.stdout + install.stderr  # type: ignore[attr-defined]
        _wait_active(c, "feosd.service")
        yield c


# Debian 13 differs from 12 in its systemd (257: DelegateSubgroup=), Python (3.13), QEMU (10.0:
# -run-with, and microvm's default firmware) and apt (3.0's solver): its root runs the tests of
# the install, the pods, the upgrade, the guests kept and the removal. The rest (the socket's
# activation and drop-in, a bad option's error, an install over a feosd from before the socket)
# is the same units and scripts on systemd's same behaviour: Debian 12 only, which saves Debian
# 13's root their restarts.
BOTH = pytest.mark.parametrize("node", ["bookworm", "trixie"], indirect=True)
DEBIAN_12 = pytest.mark.parametrize("node", ["bookworm"], indirect=True)


def _active(c: Container, unit: str) -> str:
    return c.sh(f"systemctl is-active {unit}", check=False).stdout.strip()


def _wait_active(c: Container, unit: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _active(c, unit) != "active":
        if time.monotonic() > deadline:
            raise AssertionError(f"{unit} is {_active(c, unit)}:\n{c.journal(unit)[-3000:]}")
        time.sleep(0.3)


def _show(c: Container, unit: str, prop: str) -> str:
    return c.sh(f"systemctl show -P {prop} {unit}").stdout.strip()


def _set_args(c: Container, args: str) -> None:
    c.sh(f"sed -i 's|^FEOSD_ARGS=.*|FEOSD_ARGS=\"{args}\"|' /etc/default/feosd")


DNS_QUERY = textwrap.dedent("""\
    import socket, struct
    q = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + b"\\x07example\\x03org\\x00"
    q += struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(60)
    s.sendto(q, ("169.254.0.53", 53))
    data, _ = s.recvfrom(4096)
    print(data[:2].hex(), data[3] & 15)
""")


@BOTH
def test_install_enables_starts_and_serves(node: Container) -> None:
    for unit in ("feosd.socket", "diskd.service", "feosd.service", "feos-vms.service"):
        assert _active(node, unit) == "active", node.journal(unit)
    for unit in ("feosd.socket", "diskd.service", "feosd.service"):
        assert node.sh(f"systemctl is-enabled {unit}").stdout.strip() == "enabled"
    info = node.sh("feosctl host info").stdout
    assert "feosd" in info and "QEMU" in info
    assert node.sh("getent group feos").stdout.startswith("feos:")
    assert node.sh("stat -c %a /etc/default/diskd").stdout.strip() == "600"
    assert "ublk_drv" in node.sh("cat /usr/lib/modules-load.d/diskd.conf").stdout
    # Delegate=yes always; DelegateSubgroup= where systemd has it (254 on: Debian 13)
    assert _show(node, "feosd.service", "Delegate") == "yes"
    unit = node.sh("systemctl cat feosd.service").stdout
    assert ("DelegateSubgroup=feosd" in unit) == (node.codename == "trixie")  # type: ignore[attr-defined]
    assert _show(node, "feosd.service", "KillMode") == "process"
    assert "--vms-cgroup=/system.slice/feos-vms.service" in unit


@DEBIAN_12
def test_dns_query_while_stopped_waits_in_the_socket_and_starts_feosd(node: Container) -> None:
    _set_args(node, "--pod-prefix fd12:3456:789a:1::/64")
    node.sh("systemctl reset-failed feosd.service; systemctl restart feosd.service")
    _wait_active(node, "feosd.service")
    try:
        node.sh("systemctl stop feosd.service")
        assert _active(node, "feosd.service") != "active"
        assert _active(node, "feosd.socket") == "active"  # a stop of feosd leaves the socket
        answer = node.sh(PY, input=DNS_QUERY, timeout=90).stdout.split()
        assert answer[0] == "4242"  # answered, by the feosd the query started
        assert _active(node, "feosd.service") == "active"
    finally:
        _set_args(node, "")
        node.sh("systemctl reset-failed feosd.service; systemctl restart feosd.service")
        _wait_active(node, "feosd.service")


@DEBIAN_12
def test_a_drop_in_moves_the_socket_for_another_dns_address(node: Container) -> None:
    example = "/usr/share/doc/feosd/examples/feosd.socket.d/address.conf"
    node.sh(f"mkdir -p /etc/systemd/system/feosd.socket.d && cp {example} "
            "/etc/systemd/system/feosd.socket.d/")
    _set_args(node, "--pod-prefix fd12:3456:789a:1::/64 --dns-address 169.254.1.53")
    # reset-failed: the tests restart feosd more often than systemd's start limit allows
    reload = ("systemctl daemon-reload && systemctl reset-failed feosd.service feosd.socket; "
              "systemctl stop feosd.service feosd.socket && "
              "systemctl start feosd.socket feosd.service")  # a socket refuses a running service
    try:
        node.sh(reload)
        _wait_active(node, "feosd.service")
        listen = _show(node, "feosd.socket", "Listen")
        assert "169.254.1.53:53" in listen and "169.254.0.53" not in listen, listen
        query = DNS_QUERY.replace("169.254.0.53", "169.254.1.53")
        assert node.sh(PY, input=query, timeout=90).stdout.split()[0] == "4242"
    finally:
        node.sh("rm -rf /etc/systemd/system/feosd.socket.d")
        _set_args(node, "")
        node.sh(reload)
        _wait_active(node, "feosd.service")


@DEBIAN_12
def test_a_bad_option_fails_the_unit_with_feosds_own_error(node: Container) -> None:
    _set_args(node, "--no-such-option")
    try:
        node.sh("systemctl reset-failed feosd.service; systemctl restart feosd.service", check=False)
        deadline = time.monotonic() + 30
        while _active(node, "feosd.service") not in ("failed", "inactive"):
            assert time.monotonic() < deadline, _active(node, "feosd.service")
            time.sleep(0.3)
        assert "feosd: error: unrecognized arguments: --no-such-option" in node.journal("feosd")
        assert _active(node, "feosd.service") == "failed"  # a usage error is not retried
    finally:
        _set_args(node, "")
        node.sh("systemctl reset-failed feosd.service; systemctl restart feosd.service")
        _wait_active(node, "feosd.service")


def _disk_script(call: str) -> str:
    """A call to the container's diskd with feos's own client, its disk printed as JSON."""
    return textwrap.dedent("""\
        import asyncio, json
        import capnp
        from feos.disk import DiskdConnection
        async def main():
            c = await DiskdConnection.connect("/var/lib/feos/disk/diskd.sock")
            try:
                CALL
                print(json.dumps(answer["disk"]))
            finally:
                c.close()
        asyncio.run(capnp.run(main()))
    """).replace("CALL", call)


START = _disk_script('await c.call("createDisk", id="keepme", kind="volume", sizeBytes=1 << 20, '
                     'base="")\n        answer = await c.call("startDisk", id="keepme", '
                     'vmm="firecracker", ownerUid=0)')
GET = _disk_script('answer = await c.call("getDisk", id="keepme")')


def _disk(c: Container, script: str) -> dict[str, object]:
    return json.loads(c.sh(PY, input=script).stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@BOTH
def test_restart_of_diskd_and_an_upgrade_keep_a_served_disk_and_a_pod(
        node: Container, builds: dict[str, Path], pod: str) -> None:
    disk = _disk(node, START)
    path, pid = disk["path"], disk["dataPathPid"]
    node.sh(f"printf kept-across > {path} && sync")
    before = _show(node, "diskd.service", "MainPID")
    node.sh("systemctl restart diskd.service")
    _wait_active(node, "diskd.service")
    assert _show(node, "diskd.service", "MainPID") != before
    after = _disk(node, GET)
    assert after["state"] == "started" and after["dataPathPid"] == pid
    assert node.sh(f"head -c 11 {path}").stdout == "kept-across"

    # the upgrade to the newer build: feosd and diskd restarted, the socket and the disk kept
    socket_since = _show(node, "feosd.socket", "ActiveEnterTimestampMonotonic")
    feosd_pid = _show(node, "feosd.service", "MainPID")
    assert _upgrade(node, builds)
    _wait_active(node, "feosd.service")
    _wait_active(node, "diskd.service")
    assert _show(node, "feosd.service", "MainPID") != feosd_pid
    assert _show(node, "feosd.socket", "ActiveEnterTimestampMonotonic") == socket_since
    after = _disk(node, GET)
    assert after["state"] == "started" and after["dataPathPid"] == pid
    assert node.sh(f"head -c 11 {path}").stdout == "kept-across"
    assert "feosd" in node.sh("feosctl host info").stdout
    assert _qemu_pid(node) == pod and _pod_state(node) == "running"



def _upgrade(c: Container, builds: dict[str, Path]) -> bool:
    """The newer build published and installed (once: False when it was already)."""
    if c.sh("dpkg-query -W -f '${Version}' feosd").stdout.startswith(NEW):
        return False
    _publish(builds["repo"], builds["key"], builds[NEW])
    c.sh("apt-get update -q && apt-get install -y -q feosd feosctl")
    assert c.sh("dpkg-query -W -f '${Version}' feosd").stdout.startswith(NEW)
    return True


@BOTH
def test_an_upgrade_installs_the_new_guest_beside_the_old(node: Container,
                                                          builds: dict[str, Path]) -> None:
    """The old guest stays (the pods booted with it use it), autoremove keeps both (50feosd), and
    the old one, which nothing depends on, would go alone with apt remove (simulated: a pod may
    still use it)."""
    _upgrade(node, builds)
    old_guest, new_guest = (f"feos-guest-{builds[k].name}" for k in ("guest", "newer"))
    # automatic and depended on by nothing: apt without its apt.conf.d (50feosd's
    # NeverAutoRemove) would autoremove it (APT_CONFIG is read before the parts directory)
    assert old_guest in node.sh("apt-mark showauto").stdout.split()
    node.sh("echo 'Dir::Etc::Parts \"/nonexistent\";' > /tmp/no-parts.conf")
    bare = node.sh("APT_CONFIG=/tmp/no-parts.conf apt-get -s autoremove").stdout
    assert [line.split()[1] for line in bare.splitlines() if line.startswith("Remv ")] == [
        old_guest]
    node.sh("apt-get autoremove -y -q")
    installed = node.sh("dpkg-query -W -f '${Package} ${Status}\\n' 'feos-guest*'").stdout
    for name in (old_guest, new_guest):
        assert f"{name} install ok installed" in installed, installed
    for guest in ("guest", "newer"):
        node.sh(f"test -f /usr/lib/feos/guest/{builds[guest].name}/vmlinux")
    removes = [line.split()[1] for line in
               node.sh(f"apt-get remove -s {old_guest}").stdout.splitlines()
               if line.startswith("Remv ")]
    assert removes == [old_guest]


@DEBIAN_12
def test_an_install_over_a_feosd_from_before_the_socket_stops_it_first(node: Container) -> None:
    # A feosd that holds the resolver's address itself: the socket is not active, feosd is.
    node.sh("systemctl stop feosd.socket")
    assert _active(node, "feosd.service") == "active"
    done = node.sh("apt-get install -y -q --reinstall feosd")
    assert "stopping the running feosd" in done.stderr + done.stdout
    _wait_active(node, "feosd.socket")
    _wait_active(node, "feosd.service")
    assert node.sh("feosctl host info").returncode == 0


POD = "pkgtest0001"
NO_CONTAINERS = '{"containers": [], "network": {"none": null}}'


@pytest.fixture(scope="module")
def pod(node: Container) -> str:
    """A running pod in the root: a QEMU microVM under TCG, without containers (their images
    come from a registry, which the root cannot reach) or a network; its QEMU's pid."""
    if "running" not in node.sh(f"feosctl pod get {POD}", check=False).stdout:
        node.sh(f"feosctl pod create {POD} -f - --wait", input=NO_CONTAINERS, timeout=300)
    return _qemu_pid(node)


def _qemu_pid(c: Container) -> str:
    pids = c.sh(f"pgrep -f 'qemu-system-x86_64 .*-name feos-{POD}( |$)'", check=False).stdout
    assert len(pids.split()) == 1, pids
    return pids.strip()


def _pod_state(c: Container) -> str:
    table = c.sh(f"feosctl pod get {POD}").stdout.splitlines()
    return table[1].split()[1]


@BOTH
def test_restart_of_feosd_keeps_a_running_pod(node: Container, pod: str) -> None:
    before = _show(node, "feosd.service", "MainPID")
    attached = f"guest of {POD} attached"
    seen = node.journal("feosd").count(attached)
    node.sh("systemctl reset-failed feosd.service; systemctl restart feosd.service")
    _wait_active(node, "feosd.service")
    assert _show(node, "feosd.service", "MainPID") != before
    assert _qemu_pid(node) == pod  # the same QEMU: the new feosd took it over
    deadline = time.monotonic() + 60
    while node.journal("feosd").count(attached) <= seen:  # the new feosd's link to the guest
        assert time.monotonic() < deadline, node.journal("feosd")[-3000:]
        time.sleep(0.5)
    assert _pod_state(node) == "running"


@BOTH
def test_remove_stops_and_purge_disables_keeping_the_state(node: Container) -> None:
    node.sh("touch /var/lib/feos/kept /var/lib/feos/disk/kept")
    node.sh("apt-get remove -y -q feosd diskd")
    for unit in ("feosd.service", "feosd.socket", "diskd.service"):
        assert _active(node, unit) in ("inactive", "failed", "unknown"), unit
    assert node.sh("test -e /etc/default/feosd").returncode == 0  # conffiles stay until purge
    node.sh("apt-get purge -y -q feosd diskd")
    wants = node.sh("ls /etc/systemd/system/*.wants", check=False).stdout  # purge may empty one
    assert "feosd" not in wants and "diskd" not in wants
    assert node.sh("test -e /etc/default/feosd", check=False).returncode != 0
    node.sh("test -e /var/lib/feos/kept && test -e /var/lib/feos/disk/kept")
