"""packaging/guest/_plan.py: the pure decisions of the guest image build."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from _modpath import load
from hypothesis import given
from hypothesis import strategies as st

_PATH = Path(__file__).resolve().parents[2] / "packaging/guest/_plan.py"


plan = load("feos_guest_plan", _PATH)

DEB822 = """\
Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
"""


def test_mirror_from_deb822_takes_the_binary_stanza_of_the_suite() -> None:
    assert plan.mirror_from_sources(DEB822) == "http://deb.debian.org/debian"
    assert plan.mirror_from_sources(DEB822, "bookworm-security") == (
        "http://deb.debian.org/debian-security"
    )
    assert plan.mirror_from_sources(DEB822, "trixie") is None


def test_mirror_from_one_line_sources() -> None:
    text = (
        "# deb http://old.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
        "deb http://other.example/debian bookworm main\n"
    )
    assert plan.mirror_from_list(text) == "http://mirror.example/debian"
    assert plan.mirror_from_list("deb http://m.example/d bookworm-updates main\n") is None


def test_candidate_version_and_kernel_package() -> None:
    policy = "python3:\n  Installed: (none)\n  Candidate: 3.11.2-1+b1\n  Version table:\n"
    assert plan.candidate_version(policy) == "3.11.2-1+b1"
    assert plan.candidate_version("x:\n  Installed: (none)\n  Candidate: (none)\n") is None
    depends = "linux-image-amd64\n  Depends: linux-image-6.1.0-57-amd64\n"
    assert plan.kernel_package(depends) == "linux-image-6.1.0-57-amd64"


def test_module_load_order_keeps_the_first_of_each() -> None:
    outs = [
        "insmod /k/virtio_ring.ko \ninsmod /k/virtio.ko \ninsmod /k/virtio_blk.ko \n",
        "insmod /k/virtio_ring.ko \ninsmod /k/virtio.ko \ninsmod /k/virtio-rng.ko \n",
        "builtin crc32c\ninsmod /k/ext4.ko opt=1\n",
    ]
    assert plan.module_load_order(outs) == [
        "/k/virtio_ring.ko", "/k/virtio.ko", "/k/virtio_blk.ko", "/k/virtio-rng.ko", "/k/ext4.ko"
    ]  # fmt: skip


def test_initramfs_modules_cover_the_contract() -> None:
    wanted = {"virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "virtio_net",
              "vmw_vsock_virtio_transport", "erofs", "ext4", "virtio_balloon"}  # fmt: skip
    assert wanted <= set(plan.INITRAMFS_MODULES)


def _build() -> ModuleType:
    return load("feos_guest_build_plan", _PATH.parent / "build.py")


def test_the_inputs_are_debians_packages_the_scripts_and_the_agent_alone() -> None:
    """What makes the version (apt's candidates, through the host's apt-cache): nothing of PyPI
    and no schema compiler since the agent speaks its own Cap'n Proto."""
    repo = _PATH.parents[2]
    inputs = _build().gather_inputs(repo)
    assert set(inputs) == {"suite", "kernel", "packages", "scripts", "agent"}
    assert list(inputs["packages"]) == list(plan.ROOT_PACKAGES)
    assert inputs["kernel"][0].startswith("linux-image-")
    scripts = inputs["scripts"]
    assert {"build.py", "_plan.py", "init", "feos-guest", "guest-image"} <= set(scripts)
    assert "README.md" not in scripts and "request.capnp" not in scripts
    agent = inputs["agent"]
    assert {"feos/errors.py", "feos/guest/__main__.py", "feos/guest/_wire.py",
            "feos/guest/_rpc.py", "feos/guest/_layout.py"} <= set(agent)  # fmt: skip
    assert all(k.startswith(("feos/", "schema/")) for k in agent)


@given(st.dictionaries(st.text(), st.text() | st.integers()))
def test_version_is_twelve_hex_digits_and_depends_on_the_inputs_alone(inputs: dict) -> None:  # type: ignore[type-arg]
    version = plan.input_version(inputs)
    assert len(version) == 12
    assert int(version, 16) >= 0
    assert plan.input_version(dict(reversed(list(inputs.items())))) == version
    assert plan.input_version({**inputs, "\0extra": 1}) != version


@given(st.text())
def test_source_parsers_take_any_text(text: str) -> None:
    for parse in (plan.mirror_from_sources, plan.mirror_from_list, plan.candidate_version):
        out = parse(text)
        assert out is None or isinstance(out, str)


def test_newest_version_is_the_greatest_by_build_time_then_version() -> None:
    manifests = {
        "aaa": {"built": "2026-12-01T07:00:00+00:00"},
        "ccc": {"built": "2026-12-01T08:00:00+00:00"},
        "bbb": {"built": "2026-12-01T08:00:00+00:00"},
    }
    assert plan.newest_version(manifests) == "ccc"
    assert plan.newest_version({}) is None


def test_candidate_versions_of_one_policy_call() -> None:
    policy = (
        "python3:\n  Installed: (none)\n  Candidate: 3.11.2-1+b1\n  Version table:\n"
        " *** 3.11.2-1+b1 500\n        500 http://deb.debian.org/debian bookworm/main amd64\n"
        "busybox-static:\n  Installed: 1:1.35.0-4+deb12u1+b1\n  Candidate: 1:1.35.0-4+deb12u1+b1\n"
        "nothing:\n  Installed: (none)\n  Candidate: (none)\n"
    )
    assert plan.candidate_versions(policy) == {
        "python3": "3.11.2-1+b1", "busybox-static": "1:1.35.0-4+deb12u1+b1", "nothing": None
    }  # fmt: skip


def _signed(body: bytes, sig: bytes) -> bytes:
    info = bytes(8) + len(sig).to_bytes(4, "big")  # algo, hash, id type, signer, key id len...
    return body + sig + info + b"~Module signature appended~\n"


def test_strip_module_signature_leaves_the_module() -> None:
    body = b"\x7fELF" + bytes(100)
    assert plan.strip_module_signature(_signed(body, b"S" * 515)) == body
    assert plan.strip_module_signature(body) == body


@given(st.binary(min_size=1), st.binary())
def test_strip_module_signature_of_any_signed_module(body: bytes, sig: bytes) -> None:
    assert plan.strip_module_signature(_signed(body, sig)) == body


@given(st.binary())
def test_strip_module_signature_takes_any_bytes(data: bytes) -> None:
    out = plan.strip_module_signature(data + b"~Module signature appended~\n")
    assert len(out) <= len(data) + 28


def _manifests(hours_ago: dict[str, float], now: float) -> dict[str, dict[str, object]]:
    import datetime

    return {
        v: {"built": datetime.datetime.fromtimestamp(now - h * 3600, datetime.UTC).isoformat()}
        for v, h in hours_ago.items()
    }


def test_prune_keeps_the_newest_three_the_young_and_the_used() -> None:
    now = 1_800_000_000.0
    hours = {"v1": 100, "v2": 90, "v3": 80, "v4": 30, "v5": 20, "v6": 10, "v7": 5, "v8": 1}
    m = _manifests(hours, now)
    # newest three: v8 v7 v6; younger than a day: v5 (20 h); v2 in use
    assert plan.versions_to_prune(m, {"v2"}, now) == ["v1", "v3", "v4"]
    assert plan.versions_to_prune(m, set(), now, keep_hours=0) == ["v1", "v2", "v3", "v4", "v5"]
    assert plan.versions_to_prune(m, set(), now, keep_newest=10, keep_hours=0) == []
    assert plan.versions_to_prune({}, set(), now) == []


def test_prune_keeps_a_version_whose_build_time_is_unknown_or_ahead() -> None:
    now = 1_800_000_000.0
    m = _manifests({"a": 50, "b": 40, "c": 30, "d": 20}, now)
    m["old-no-time"] = {}
    m["bad-time"] = {"built": "yesterday"}
    m["ahead"] = _manifests({"x": -5}, now)["x"]
    # "bad-time" sorts as the newest ("y" > "2"): kept as such, as the unknown and the ahead are
    assert plan.versions_to_prune(m, set(), now, keep_newest=1, keep_hours=0) == ["a", "b", "c", "d"]


@given(
    st.dictionaries(st.text("0123456789abcdef", min_size=1, max_size=4),
                    st.floats(-10, 1000), max_size=12),
    st.sets(st.text("0123456789abcdef", min_size=1, max_size=4), max_size=4),
    st.integers(0, 5),
    st.floats(0, 200),
)  # fmt: skip
def test_prune_never_removes_a_kept_version(
    hours: dict[str, float], used: set[str], keep: int, keep_hours: float
) -> None:
    now = 1_800_000_000.0
    m = _manifests(hours, now)
    gone = plan.versions_to_prune(m, used, now, keep_newest=keep, keep_hours=keep_hours)
    newest = sorted(m, key=lambda v: (str(m[v]["built"]), v), reverse=True)[:keep]
    assert len(set(gone)) == len(gone)
    for v in gone:
        assert v in m and v not in used and v not in newest
        assert hours[v] * 3600 >= keep_hours * 3600 - 1e-3  # old enough (ISO rounding aside)
    young = {v for v, h in hours.items() if h < keep_hours - 0.01}
    assert not young & set(gone)
