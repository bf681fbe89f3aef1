"""The cgroup layouts and plans, without a cgroup filesystem (the kernel tier runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feos.errors import FeosError
from feos.vmm import _cgroup as cg

PROC_HYBRID = """\
9:name=systemd:/
8:pids:/
4:memory:/process_api/e457
2:cpu,cpuacct:/
0::/
"""

MOUNTINFO_HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_proc_cgroup_by_hierarchy() -> None:
    got = cg.parse_proc_cgroup(PROC_HYBRID)
    assert got == {"name=systemd": "/", "pids": "/", "memory": "/process_api/e457",
                   "cpu": "/", "cpuacct": "/", "": "/"}


def test_mountinfo_cgroup_mounts() -> None:
    mounts = cg.parse_mountinfo(MOUNTINFO_HYBRID)
    assert [(str(m.mount_point), m.version, sorted(m.controllers)) for m in mounts] == [
        ("/sys/fs/cgroup/cpu,cpuacct", 1, ["cpu", "cpuacct"]),
        ("/sys/fs/cgroup/memory", 1, ["memory"]),
        ("/sys/fs/cgroup/pids", 1, ["pids"]),
        ("/sys/fs/cgroup/systemd", 1, []),
        ("/sys/fs/cgroup/unified", 2, []),
    ]


def test_mountinfo_unescapes_paths() -> None:
    line = "50 31 0:40 /a\\040b /mnt/c\\040g rw - cgroup2 cgroup2 rw\n"
    (m,) = cg.parse_mountinfo(line)
    assert (m.mount_point, m.root) == (Path("/mnt/c g"), "/a b")


@given(st.text())
def test_parsers_take_any_text(text: str) -> None:
    for path in cg.parse_proc_cgroup(text).values():
        assert path.startswith("/")
    for m in cg.parse_mountinfo(text):
        assert m.version in (1, 2)


def test_weights_scale_per_vcpu() -> None:
    assert [cg.weight_of(n) for n in (1, 2, 32)] == [100, 200, 3200]
    assert [cg.shares_of(n) for n in (1, 2, 32)] == [1024, 2048, 32768]
    assert cg.weight_of(1000) == 10000


def _v1() -> cg.V1Layout:
    return cg.V1Layout(bases={h: Path(f"/sys/fs/cgroup/{h}/feosd") for h in cg.V1_HIERARCHIES})


def test_v1_plan_is_shares_alone() -> None:
    layout = _v1()
    assert cg.prepare_plan(layout) == (
        [Path(f"/sys/fs/cgroup/{h}/feosd/vms") for h in cg.V1_HIERARCHIES], [])
    assert cg.vm_plan(layout, "abc", 3) == [
        cg.Write(Path("/sys/fs/cgroup/cpu/feosd/vms/abc/cpu.shares"), "3072")]


def test_v2_plan_enables_in_base_and_vms_only() -> None:
    layout = cg.V2Layout(base=Path("/cg/pod"), leaf=Path("/cg/pod/feosd"))
    dirs, writes = cg.prepare_plan(layout)
    assert dirs == [Path("/cg/pod/feosd"), Path("/cg/pod/vms")]
    assert writes == [cg.Write(Path("/cg/pod/cgroup.subtree_control"), "+cpu +memory"),
                      cg.Write(Path("/cg/pod/vms/cgroup.subtree_control"), "+cpu +memory")]
    assert cg.vm_plan(layout, "x", 2) == [cg.Write(Path("/cg/pod/vms/x/cpu.weight"), "200")]


def test_v2_layout_rules(tmp_path: Path) -> None:
    root = tmp_path / "root"
    child = root / "pod"
    (child / "feosd").mkdir(parents=True)
    for d in (child, child / "feosd"):
        (d / "cgroup.type").write_text("domain\n")
    assert cg.v2_layout_for(root) == cg.V2Layout(base=root, leaf=None)
    assert cg.v2_layout_for(child) == cg.V2Layout(base=child, leaf=child / "feosd")
    assert cg.v2_layout_for(child / "feosd") == cg.V2Layout(base=child, leaf=None)
    given_ = root / "feos-vms.service"
    assert cg.v2_layout_for(child, given=given_) == cg.V2Layout(base=given_, leaf=None)


def test_jailer_args_when_one_parent_serves_all() -> None:
    mounts = [cg.CgroupMount(Path(f"/sys/fs/cgroup/{h}"), "/", 1, frozenset({h}))
              for h in cg.V1_HIERARCHIES]
    assert cg.jailer_args(_v1(), "abc", 2, mounts) == [
        "--cgroup-version", "1", "--parent-cgroup", "feosd/vms",
        "--cgroup", "cpu.shares=2048", "--cgroup", "memory.limit_in_bytes=-1",
        "--cgroup", "pids.max=max"]


def test_no_jailer_args_when_hierarchies_differ() -> None:
    mounts = cg.parse_mountinfo(MOUNTINFO_HYBRID)
    layout = cg.V1Layout(bases={"cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
                                "memory": Path("/sys/fs/cgroup/memory/process_api/e457")})
    assert cg.jailer_args(layout, "abc", 1, mounts) is None
    assert cg.jailer_args(cg.V2Layout(base=Path("/x"), leaf=None), "abc", 1, mounts) is None


def test_detect_v1_on_a_hybrid_host(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(PROC_HYBRID)
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    (proc / "mountinfo").write_text(MOUNTINFO_HYBRID.replace("/sys/fs/cgroup/unified",
                                                             str(unified)))
    layout = cg.detect(proc=proc)
    assert layout == cg.V1Layout(bases={
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
        "memory": Path("/sys/fs/cgroup/memory/process_api/e457"),
        "pids": Path("/sys/fs/cgroup/pids")})


def test_detect_v2_with_controllers(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/kubepods/pod1\n")
    mnt = tmp_path / "cgroup"
    (mnt / "kubepods" / "pod1").mkdir(parents=True)
    (mnt / "kubepods" / "pod1" / "cgroup.type").write_text("domain\n")
    (mnt / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (proc / "mountinfo").write_text(f"41 31 0:38 / {mnt} rw - cgroup2 cgroup2 rw\n")
    pod = mnt / "kubepods" / "pod1"
    assert cg.detect(proc=proc) == cg.V2Layout(base=pod, leaf=pod / "feosd")


def test_detect_without_any_cpu_hierarchy(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("0::/\n")
    (tmp_path / "mountinfo").write_text("")
    with pytest.raises(FeosError, match="cpu controller"):
        cg.detect(proc=tmp_path)


def test_unit_cgroup_strips_feosd_and_control_subgroups() -> None:
    from feos.vmm import _cgroup as cg

    assert cg.unit_cgroup("/system.slice/feosd.service/feosd") == "/system.slice/feosd.service"
    assert cg.unit_cgroup("/system.slice/feosd.service/.control") == "/system.slice/feosd.service"
    assert cg.unit_cgroup("/system.slice/feosd.service") == "/system.slice/feosd.service"
    assert cg.unit_cgroup("/feosd") == "/"


def test_hand_over_pairs_by_hierarchy() -> None:
    from pathlib import Path

    from feos.vmm import _cgroup as cg

    old = cg.V1Layout(bases={"cpu": Path("/c/u"), "memory": Path("/m/u")})
    new = cg.V1Layout(bases={"cpu": Path("/c/v")})
    assert cg.hand_over_pairs(old, new, "a") == [(Path("/c/u/vms/a"), Path("/c/v/vms/a"))]
    v2 = cg.V2Layout(base=Path("/u"), leaf=None)
    assert cg.hand_over_pairs(v2, cg.V2Layout(base=Path("/v"), leaf=None), "a") == [
        (Path("/u/vms/a"), Path("/v/vms/a"))]
    assert cg.hand_over_pairs(old, v2, "a") == []


def test_vms_cgroup_options_are_checked(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from feos.daemon import parse_args

    args = parse_args(["--vms-cgroup", "/system.slice/feos-vms.service", "--hand-over-vms"])
    assert args.vms_cgroup == "/system.slice/feos-vms.service" and args.hand_over_vms
    with pytest.raises(SystemExit):
        parse_args(["--hand-over-vms"])
    assert "--hand-over-vms: needs --vms-cgroup" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--vms-cgroup", "system.slice"])
    assert "--vms-cgroup: must be a cgroup path starting with /" in capsys.readouterr().err
