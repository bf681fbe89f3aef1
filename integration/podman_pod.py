"""feos-node's pod (packaging/kubernetes) run by podman, as a kubelet would run the DaemonSet's.

Not a test file: integration/test_kubernetes_pod.py imports it (with integration/ on sys.path).

    with PodmanNode(tmp_path) as node:   # PodNet's namespaces, registry and resolver
        node.ctl("pod", "create", ...)   # feosctl on the host, through the pod's /run/feos
        node.end_pod()                   # feosd SIGTERMed within the grace, then diskd
        node.start_feosd()               # a new pod: the next feosd on the node

The image is hack/oci-image's (the .debs of this tree; cached by the tree). A pod is made as the
DaemonSet makes one, with what podman has for each of its parts:

- the infra container (catatonit) is PID 1 of the pod's shared PID namespace
  (shareProcessNamespace); feosd is not;
- the init container `versions` copies the image's Firecracker and guest versions into the
  "host's" /usr/lib/feos (a directory of the test), mounted at /usr/lib/feos/{firecracker,guest};
- diskd, then feosd, privileged, with the "host's" /var/lib/feos (the test's state directory,
  made a shared mount so that diskd's FUSE exports reach feosd: mountPropagation
  Bidirectional), /dev, and /run/feos (the test's run directory: feosctl reaches the API);
  feosd with a cgroup namespace of its own, as containerd gives a container on cgroup v2;
- the host's network is PodNet's node namespace (hostNetwork, without touching this machine's).

What only a kubelet does, the harness does in its order: diskd (the sidecar) starts before feosd,
and `end_pod` stops feosd (SIGTERM, then SIGKILL after the grace) before diskd. podman runs
containers with runc: crun 1.8 refuses this machine's hybrid cgroups, and the rlimits are the
test's own (podman's defaults exceed what root may raise to here).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from _owner import OWNER
from podnet import REPO, PodNet, sh

STOP_GRACE = 120  # feosd's --stop-grace and the pod's grace (terminationGracePeriodSeconds)
ANY_HIERARCHY = ("cpu", "memory", "pids")


def oci_image() -> str:
    """hack/oci-image's image of this tree (built when the tree changed, else tagged again)."""
    done = subprocess.run([str(REPO / "hack/oci-image")], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise AssertionError(f"hack/oci-image failed: {done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def containers_conf(path: Path) -> Path:
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    procs = min(resource.getrlimit(resource.RLIMIT_NPROC)[1] & 0x7FFFFFFF, 32768)
    path.write_text(f'[containers]\ndefault_ulimits = ["nofile={files}:{files}", '
                    f'"nproc={procs}:{procs}"]\n[engine]\nruntime = "runc"\n')
    return path


class PodmanNode(PodNet):
    def __init__(self, root: Path, *feosd_args: str) -> None:
        super().__init__(root, "--suspend-on-stop", f"--stop-grace={STOP_GRACE}", *feosd_args)
        self.versions = root / "host-usr-lib-feos"
        self.env = dict(os.environ, CONTAINERS_CONF=str(containers_conf(root / "containers.conf")))
        self.image = ""
        self.generation = 0
        self.pod = ""
        self._shared = False

    # -- podman ----------------------------------------------------------------------------

    def podman(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run(["podman", *argv], capture_output=True, text=True, env=self.env,
                              timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"podman {' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def name(self, container: str) -> str:
        return f"{self.pod}-{container}"

    def host_pid(self, container: str) -> int:
        return int(self.podman("inspect", "-f", "{{.State.Pid}}", self.name(container)))

    def exit_code(self, container: str) -> int:
        return int(self.podman("inspect", "-f", "{{.State.ExitCode}}", self.name(container)))

    def logs(self, container: str) -> str:
        """The container's output (podman logs gives its stderr on stderr)."""
        return subprocess.run(["podman", "logs", self.name(container)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=self.env,
                              timeout=60).stdout

    # -- the pod ---------------------------------------------------------------------------

    def start_feosd(self, timeout: float = 120) -> Any:
        """A new feos-node pod, as a rollout makes one: versions, diskd, then feosd."""
        if not self.image:
            self.image = oci_image()
            self._share_state_dir()
        self.generation += 1
        self.pod = f"{self.node_ns}-{self.generation}"
        pod = self.pod
        OWNER.undo(pod, lambda: self.podman("pod", "rm", "-f", "-t", "0", pod, check=False))
        self.podman("pod", "create", "--name", pod, "--share", "pid")
        network = ["--network", f"ns:/run/netns/{self.node_ns}"]
        common = ["--pod", pod, *network, "--privileged"]
        self.versions.mkdir(parents=True, exist_ok=True)
        self.podman("run", "--rm", "--name", self.name("versions"), *common,
                    "-v", f"{self.versions}:/host/usr/lib/feos", self.image,
                    "/usr/share/feos/install-versions", "/host/usr/lib/feos", timeout=300)
        state = ["-v", f"{self.state_dir}:/var/lib/feos:rshared"]
        self.podman("run", "-d", "--name", self.name("diskd"), *common, *state, self.image,
                    "/usr/sbin/diskd", "--state-dir=/var/lib/feos/disk",
                    "--stop-after-lock=/var/lib/feos/feosd.lock")
        self.feosd.run_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.feosd.socket.unlink()
        versions = [a for kind in ("firecracker", "guest")
                    for a in ("-v", f"{self.versions / kind}:/usr/lib/feos/{kind}:ro")]
        self.podman("run", "-d", "--name", self.name("feosd"), *common, "--cgroupns=private",
                    *state, *versions, "-v", f"{self.feosd.run_dir}:/run/feos", self.image,
                    "/usr/sbin/feosd", *self.feosd.args)
        self._wait_serving(timeout)
        return self.feosd

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = self.podman("inspect", "-f", "{{.State.Running}}", self.name("feosd"))
            if running != "true":
                raise AssertionError(f"feosd's container ended:\n{self.logs('feosd')}")
            if self.feosd.socket.exists() and self.ctl("host", "info", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"feosd did not serve within {timeout}s:\n{self.logs('feosd')}")

    def _share_state_dir(self) -> None:
        """The state directory a shared mount of its own (the node's /var/lib/feos is one where
        a kubelet mounts it Bidirectional); undone at the close."""
        state = str(self.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        sh("mount", "--bind", state, state)
        self._shared = True
        OWNER.undo(state, lambda: subprocess.run(["umount", "-R", "-l", state],
                                                 capture_output=True))
        sh("mount", "--make-shared", state)

    def sigterm_feosd(self) -> None:
        """The kubelet's SIGTERM to feosd's container, without waiting for its end."""
        self.podman("kill", "--signal", "TERM", self.name("feosd"))

    def kill_feosd(self) -> None:
        """A kill past the grace (or the OOM killer): SIGKILL to feosd's container."""
        self.podman("kill", "--signal", "KILL", self.name("feosd"), check=False)
        self.podman("wait", self.name("feosd"), check=False, timeout=60)

    def end_pod(self, timeout: float = STOP_GRACE) -> int:
        """The pod's end as a kubelet orders it: feosd first, SIGTERM and SIGKILL after the
        grace, then the sidecar diskd; feosd's exit code."""
        self.podman("stop", "-t", str(int(timeout)), self.name("feosd"), timeout=timeout + 60)
        code = self.exit_code("feosd")
        self.podman("stop", "-t", "30", self.name("diskd"), timeout=90)
        self.podman("pod", "rm", "-f", "-t", "0", self.pod)
        OWNER.forget(self.pod)
        return code

    def stop_feosd(self, timeout: float = STOP_GRACE) -> int:
        return self.end_pod(timeout)

    def remove_pod(self) -> None:
        """What is left of a pod whose feosd ended: diskd stopped, the pod removed."""
        self.podman("stop", "-t", "30", self.name("diskd"), check=False, timeout=90)
        self.podman("pod", "rm", "-f", "-t", "0", self.pod)
        OWNER.forget(self.pod)

    # -- what runs in it -------------------------------------------------------------------

    def pid_namespace(self) -> int:
        return os.stat(f"/proc/{self.host_pid('feosd')}/ns/pid").st_ino

    def qemus(self) -> dict[str, int]:
        """The microVMs' QEMUs by pod ID, as host pids: their qemu.pid holds the pid in the
        pod's PID namespace."""
        inner = {}
        for pidfile in self.state_dir.glob("vms/*/*/qemu.pid"):
            with contextlib.suppress(ValueError, IndexError, OSError):
                inner[int(pidfile.read_text().split()[0])] = pidfile.parent.name
        found = {}
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                nspid = next(line for line in status.read_text().splitlines()
                             if line.startswith("NSpid:")).split()[1:]
                pid = int(nspid[0])
                if len(nspid) < 2 or int(nspid[-1]) not in inner:
                    continue
                if b"qemu-system" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found[inner[int(nspid[-1])]] = pid
        return found

    def cgroups_of(self, pid: int) -> dict[str, str]:
        """A host process's cgroup by v1 hierarchy (as the host sees them)."""
        out = {}
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(","):
                out[name] = path
        return out

    def environ_of(self, pid: int) -> dict[str, str]:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().partition("=")[::2] for item in raw if item)

    def close(self) -> None:
        if self.pod:
            self.podman("pod", "rm", "-f", "-t", "0", self.pod, check=False)
            OWNER.forget(self.pod)
        if self._shared:
            subprocess.run(["umount", "-R", "-l", str(self.state_dir)], capture_output=True)
            OWNER.forget(str(self.state_dir))
            self._shared = False
        super().close()


def record(node: PodmanNode) -> list[str]:
    """The pods in the suspend-on-stop record (none when there is no record)."""
    try:
        return list(json.loads((node.state_dir / "suspended-for-stop.json").read_text())["pods"])
    except (FileNotFoundError, json.JSONDecodeError):
        return []
