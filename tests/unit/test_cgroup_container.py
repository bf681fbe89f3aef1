"""feosd's container mode: found by its cgroup namespace; feosd into feosd/ of the container's
cgroup, the microVMs into vms/<id> beside it, on cgroup v2 and v1 (node.md, "On Kubernetes").

The layouts are decided from /proc texts and a cgroup tree made of plain directories here; the
kernel tier (tests/kernel/test_cgroup_vms.py, test_cgroup_namespace.py) and the container's integration test
(integration/test_kubernetes_pod.py) run them on real cgroups.
"""

from __future__ import annotations

import os
from pathlib import Path

from feos.vmm import _cgroup as cg

# What a privileged container with a cgroup namespace of its own sees (podman --cgroupns=private
# on this machine's hybrid hierarchy): every cgroup is /, every mount's root too.
PROC_CONTAINER_V1 = """\
9:name=systemd:/
8:pids:/
4:memory:/
2:cpu,cpuacct:/
0::/
"""


def mountinfo_v1(root: Path) -> str:
    return "".join(f"{40 + i} 31 0:{29 + i} / {root / h} rw - cgroup cgroup rw,{h}\n"
                   for i, h in enumerate(("cpu", "memory", "pids")))


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "ns").mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def test_the_initial_namespace_is_no_container(tmp_path: Path) -> None:
    # this test's own namespace decides nothing: the answer follows the inode of ns/cgroup
    mine = os.stat("/proc/self/ns/cgroup").st_ino
    assert cg.own_cgroup_namespace() is (mine != cg.INITIAL_CGROUP_NAMESPACE)
    proc = tmp_path / "proc"
    (proc / "ns").mkdir(parents=True)
    (proc / "ns" / "cgroup").write_text("")  # any other inode: a namespace of its own
    assert cg.own_cgroup_namespace(proc)
    assert not cg.own_cgroup_namespace(tmp_path / "no-such-proc")  # a kernel without any


def test_v1_container_moves_feosd_into_feosd_of_each_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    proc = fake_proc(tmp_path, PROC_CONTAINER_V1, mountinfo_v1(root))
    layout = cg.detect(proc=proc, container=True)
    assert layout == cg.V1Layout(bases={h: root / h for h in cg.V1_HIERARCHIES},
                                 leaves={h: root / h / "feosd" for h in cg.V1_HIERARCHIES})
    dirs, writes = cg.prepare_plan(layout)
    assert dirs == [*(root / h / "feosd" for h in cg.V1_HIERARCHIES),
                    *(root / h / "vms" for h in cg.V1_HIERARCHIES)]
    assert writes == []
    assert cg.moves(layout) == [(root / h, root / h / "feosd") for h in cg.V1_HIERARCHIES]
    assert cg.vm_dirs(layout, "p1") == [root / h / "vms" / "p1" for h in cg.V1_HIERARCHIES]


def test_v1_outside_a_container_feosd_stays(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    proc = fake_proc(tmp_path, PROC_CONTAINER_V1, mountinfo_v1(root))
    layout = cg.detect(proc=proc, container=False)
    assert layout == cg.V1Layout(bases={h: root / h for h in cg.V1_HIERARCHIES})
    assert cg.moves(layout) == []


def test_v1_container_feosd_already_in_its_leaf(tmp_path: Path) -> None:
    # a self-upgrade's exec keeps the pid, and so the cgroup feosd moved into
    root = tmp_path / "cg"
    proc = fake_proc(tmp_path, PROC_CONTAINER_V1.replace(":/\n", ":/feosd\n"), mountinfo_v1(root))
    layout = cg.detect(proc=proc, container=True)
    assert layout == cg.V1Layout(bases={h: root / h for h in cg.V1_HIERARCHIES})
    assert cg.moves(layout) == []


def test_v2_container_root_is_never_the_real_root(tmp_path: Path) -> None:
    # a cgroup namespace's root shows as / and has cgroup.type; even without the file (a tree
    # of plain directories here) a container's cgroup is not the hierarchy's root
    mnt = tmp_path / "cgroup"
    mnt.mkdir()
    (mnt / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc = fake_proc(tmp_path, "0::/\n", f"41 31 0:38 / {mnt} rw - cgroup2 cgroup2 rw\n")
    assert cg.detect(proc=proc, container=False) == cg.V2Layout(base=mnt, leaf=None)
    layout = cg.detect(proc=proc, container=True)
    assert layout == cg.V2Layout(base=mnt, leaf=mnt / "feosd")
    assert cg.prepare_plan(layout) == (
        [mnt / "feosd", mnt / "vms"],
        [cg.Write(mnt / "cgroup.subtree_control", "+cpu +memory"),
         cg.Write(mnt / "vms" / "cgroup.subtree_control", "+cpu +memory")])
    assert cg.moves(layout) == [(mnt, mnt / "feosd")]


def test_v2_container_the_namespace_root_with_cgroup_type(tmp_path: Path) -> None:
    mnt = tmp_path / "cgroup"
    mnt.mkdir()
    (mnt / "cgroup.controllers").write_text("cpu memory\n")
    (mnt / "cgroup.type").write_text("domain\n")
    proc = fake_proc(tmp_path, "0::/\n", f"41 31 0:38 / {mnt} rw - cgroup2 cgroup2 rw\n")
    assert cg.detect(proc=proc) == cg.V2Layout(base=mnt, leaf=mnt / "feosd")


def test_vms_cgroup_wins_over_the_container(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    proc = fake_proc(tmp_path, PROC_CONTAINER_V1, mountinfo_v1(root))
    layout = cg.detect(proc=proc, container=True, vms_cgroup="/feos-vms")
    assert layout == cg.V1Layout(bases={h: root / h / "feos-vms" for h in cg.V1_HIERARCHIES})


def test_prepare_moves_the_container_processes_on_v1(tmp_path: Path) -> None:
    # plain directories stand for cgroupfs: prepare writes each pid into the leaf's cgroup.procs
    root = tmp_path / "cg"
    for h in cg.V1_HIERARCHIES:
        (root / h).mkdir(parents=True)
        (root / h / "cgroup.procs").write_text("7\n9\n")
    layout = cg.v1_layout_for({h: root / h for h in cg.V1_HIERARCHIES}, container=True)
    cg.prepare(layout)
    for h in cg.V1_HIERARCHIES:
        assert (root / h / "feosd" / "cgroup.procs").read_text() == "9"  # the last write
        assert (root / h / "vms").is_dir()
