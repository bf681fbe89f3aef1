"""Containers run by crun from bundles the agent makes, named by the node, kept on /data.

<data>/containers/<name>/state.json   the record: config (token-free), image, status, times
<data>/containers/<name>/bundle/       config.json; rootfs/, an overlayfs of the image's layers
                                       (the image store's, shared) under upper/ (its own)
<data>/containers/<name>/stdout.log, stderr.log

A start runs `crun run` as the agent's child, which lives as long as the container and ends with
its exit code. An agent that starts finds its records: a container recorded running whose crun
still runs (the agent restarted, not the guest) is watched by a pidfd; one whose crun is gone
(the guest rebooted) is stopped, exit code -1.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import time

from feos.errors import Code, FeosError

from . import _oci, _proc, _validate
from ._images import ImageStore, Phases, write_whole
from ._token import PullToken

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any

CREATED, RUNNING, STOPPED = "created", "running", "stopped"
STOP_TIMEOUT = 10.0


def _now() -> int:
    return time.time_ns()


class Saves:
    """While /data is frozen, a record's write would block the agent: they wait for the thaw."""

    def __init__(self) -> None:
        self.frozen = False
        self.dirty: dict[str, Container] = {}

    def thawed(self) -> None:
        self.frozen = False
        for c in list(self.dirty.values()):
            if os.path.isdir(c.dir):
                c.save()
        self.dirty.clear()


class Container:
    def __init__(self, directory: str, record: dict[str, Any], saves: Saves) -> None:
        self.saves = saves
        self.dir = directory
        self.record = record
        self.lock = asyncio.Lock()
        self.child: _proc.Child | None = None
        self.ended = asyncio.Event()
        self.watcher: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        return str(self.record["config"]["name"])

    @property
    def status(self) -> str:
        return str(self.record["status"])

    def save(self, *, sync: bool = True) -> None:
        if self.saves.frozen:
            self.saves.dirty[self.dir] = self
            return
        write_whole(os.path.join(self.dir, "state.json"), json.dumps(self.record).encode(),
                    sync=sync)

    def log(self, which: str) -> str:
        return os.path.join(self.dir, f"{which}.log")


class Containers:
    def __init__(
        self, data_dir: str, volumes_dir: str, resolv_conf: str, crun_root: str, crun_cgroups: str,
        images: ImageStore, reaper: _proc.Reaper,
    ) -> None:  # fmt: skip
        self.root = os.path.join(data_dir, "containers")
        self.volumes_dir = volumes_dir
        self.resolv_conf = resolv_conf
        self.crun_root = crun_root
        self.crun = ["crun", "--root", crun_root]
        if crun_cgroups:
            self.crun.append(f"--cgroup-manager={crun_cgroups}")
        self.images = images
        self.reaper = reaper
        self._all: dict[str, Container] = {}
        self.saves = Saves()
        self.exec_dir = crun_root.rstrip("/") + "-exec"  # process.json and console sockets
        self._execs = 0
        self._gate: int | None = None  # _size_gate's fd once looked for; -1: there is none
        self.hostname = ""  # the pod's (assume): the containers' from then on; else their names
        self.machine_id = ""  # the file the containers see as /etc/machine-id

    def identity(self, hostname: str, machine_id: str) -> None:
        self.hostname, self.machine_id = hostname, machine_id

    # The records --------------------------------------------------------------------------

    async def load(self) -> None:
        """Takes the records on /data up; runs once, when the agent starts."""
        os.makedirs(self.root, exist_ok=True)
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            if entry.endswith(".creating") or entry.endswith(".deleting"):
                _unmount_under(path)  # its rootfs, where only the agent restarted
                shutil.rmtree(path, ignore_errors=True)  # a create or delete cut off
                continue
            try:
                with open(os.path.join(path, "state.json"), "rb") as f:  # noqa: ASYNC230
                    c = Container(path, json.load(f), self.saves)
            except (OSError, ValueError) as e:
                print(f"feos-guest: container {entry}: unreadable record: {e}", flush=True)
                continue
            self._all[c.name] = c
            if c.status == RUNNING:
                await self._adopt(c)

    async def _adopt(self, c: Container) -> None:
        pid = int(c.record.get("pid") or 0)
        code, out, _ = await _proc.run(self.reaper, [*self.crun, "state", c.name])
        running = code == 0 and json.loads(out or "{}").get("status") == "running"
        if running and pid:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                running = False
            else:
                asyncio.get_running_loop().add_reader(fd, self._adopted_ended, c, fd)
                return
        await _proc.run(self.reaper, [*self.crun, "delete", "-f", c.name])
        self._finish(c, -1)

    def _adopted_ended(self, c: Container, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        self._finish(c, -1)

    def _finish(self, c: Container, code: int) -> None:
        c.record.update(status=STOPPED, exitCode=code, finishedNs=_now(), pid=0)
        c.child = None
        c.save()
        c.ended.set()

    def get(self, name: str) -> Container:
        _validate.container_name("name", name)
        c = self._all.get(name)
        if c is None:
            raise FeosError(Code.NOT_FOUND, f"no container {name}")
        return c

    def all(self) -> list[Container]:
        return [self._all[n] for n in sorted(self._all)]

    # Lifecycle ----------------------------------------------------------------------------

    async def create(self, config: dict[str, Any], token: PullToken | None) -> Container:
        name = config["name"]
        found = self._all.get(name)
        if found is not None:
            if found.record["config"] != config:
                raise FeosError(Code.ALREADY_EXISTS, f"container {name} exists with another config")
            return found
        phases = Phases()
        binds = self._binds(config)
        image = await self.images.ensure(config["image"], token)
        phases.mark("image")
        if name in self._all:  # made by another create while this one pulled
            return await self.create(config, None)
        final = os.path.join(self.root, name)
        work = final + ".creating"
        record = {"config": config, "imageDigest": image.digest, "status": CREATED, "pid": 0,
                  "exitCode": 0, "createdNs": _now(), "startedNs": 0, "finishedNs": 0}  # fmt: skip
        self._all[name] = c = Container(final, record, self.saves)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self._make_bundle, work, image, config, binds, record, phases
            )
            os.rename(work, final)
        except BaseException:
            del self._all[name]
            _unmount_under(work)
            shutil.rmtree(work, ignore_errors=True)
            raise
        print(f"feos-guest: container {name} made in {phases.line()}", flush=True)
        return c

    def _binds(self, config: dict[str, Any]) -> list[tuple[str, str, bool]]:
        binds = []
        for m in config["volumeMounts"]:
            source = os.path.join(self.volumes_dir, m["name"])
            if not os.path.ismount(source):
                raise FeosError(Code.FAILED_PRECONDITION, f"volume {m['name']} is not mounted")
            binds.append((source, m["path"], m["readOnly"]))
        return binds

    def _make_bundle(self, work: str, image: Any, config: dict[str, Any], binds: list[Any],
                     record: dict[str, Any], phases: Phases) -> None:  # fmt: skip
        if os.path.lexists(work):  # a create cut off (shutil only then: its import, with bz2
            shutil.rmtree(work, ignore_errors=True)  # and lzma, is 45 ms under TCG)
        rootfs = os.path.join(work, "bundle", "rootfs")
        os.makedirs(rootfs)
        lowers = self.images.unpack_layers(image)
        phases.mark("layers")
        why = _mount_rootfs(rootfs, lowers)
        if why is None:
            record["rootfs"] = "overlay"
            record["layers"] = [d for d, _ in image.layers]  # a later pull of its tag: others
        else:  # a kernel without overlayfs, or too many layers for one mount's options
            print(f"feos-guest: container {config['name']}: no overlay ({why}): the layers "
                  "are copied", flush=True)  # fmt: skip
            self.images.unpack(image, rootfs)
            phases.mark("unpack")
        ic = image.config
        try:
            uid, gid = _oci.user_ids(str(ic.get("User") or ""), _read(rootfs, "etc/passwd"),
                                     _read(rootfs, "etc/group"))  # fmt: skip
        except ValueError as e:
            raise FeosError(Code.FAILED_PRECONDITION, f"image {config['image']}: {e}") from None
        for _, dest, _ in binds:
            os.makedirs(os.path.join(rootfs, dest.lstrip("/")), exist_ok=True)
        args = _oci.process_args(config["command"], ic)
        env = _oci.merge_env(list(ic.get("Env") or []), config["env"])
        cwd = config["workingDir"] or str(ic.get("WorkingDir") or "/")
        _check_command(rootfs, args[0], env, cwd, [dest for _, dest, _ in binds], config)
        spec = _oci.config(
            hostname=self.hostname or config["name"], args=args, env=env, cwd=cwd, uid=uid,
            gid=gid, resolv_conf=self.resolv_conf, binds=binds,
        )  # fmt: skip
        if self.machine_id:
            _machine_id_in(rootfs, spec, self.machine_id)
        write_whole(os.path.join(work, "bundle", "config.json"), json.dumps(spec).encode())
        write_whole(os.path.join(work, "state.json"), json.dumps(record).encode())
        phases.mark("records")

    def _remount(self, c: Container) -> None:
        rootfs = os.path.join(c.dir, "bundle", "rootfs")
        if os.path.ismount(rootfs):
            return
        lowers = [self.images.layer_dir(d) for d in c.record.get("layers") or []]
        missing = [d for d in lowers if not os.path.isdir(d)]
        if missing:
            raise FeosError(Code.FAILED_PRECONDITION, f"container {c.name}: its image's layer "
                            f"{os.path.basename(missing[0])[:12]} is no longer in the guest's "
                            "store")  # fmt: skip
        why = _mount_rootfs(rootfs, lowers)
        if why is not None:
            raise FeosError(Code.INTERNAL, f"container {c.name}: its rootfs: {why}")

    async def start(self, name: str) -> Container:
        c = self.get(name)
        async with c.lock:
            if c.status == RUNNING:
                return c
            phases = Phases()
            # A stale state of crun's (a run cut off) is deleted first; crun under TCG takes
            # 0.09 s, so only when its state is there (its root is a tmpfs: no blocking stat).
            if os.path.lexists(os.path.join(self.crun_root, name)):  # noqa: ASYNC240
                await _proc.run(self.reaper, [*self.crun, "delete", "-f", name])
                phases.mark("crun delete")
            if c.record.get("rootfs") == "overlay":  # a guest that booted again lost the mount
                await asyncio.get_running_loop().run_in_executor(None, self._remount, c)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            out, err = (
                os.open(c.log("stdout"), flags, 0o640),
                os.open(c.log("stderr"), flags, 0o640),
            )
            try:
                bundle = os.path.join(c.dir, "bundle")
                child = self.reaper.spawn([*self.crun, "run", "--bundle", bundle, name],
                                          stdout=out, stderr=err, setsid=True)  # fmt: skip
            finally:
                os.close(out)
                os.close(err)
            phases.mark("spawn")
            c.child, c.ended = child, asyncio.Event()
            c.record.update(
                status=RUNNING, pid=child.pid, startedNs=_now(), finishedNs=0, exitCode=0
            )
            # Not synced (an fsync on the start's path: 10 ms, 100 ms and more with ten guests
            # on one disk): a crash of the guest ends the container, and the record it leaves,
            # created or running with a pid that is gone, loads as a container that does not
            # run. An agent that restarts without a crash reads the page cache's record.
            c.save(sync=False)
            phases.mark("record")
            c.watcher = asyncio.ensure_future(self._watch(c, child))
            print(f"feos-guest: container {name} started in {phases.line()}", flush=True)
            return c

    async def _watch(self, c: Container, child: _proc.Child) -> None:
        code = await child.exited
        if c.child is child:
            self._finish(c, code)
            await _proc.run(self.reaper, [*self.crun, "delete", "-f", c.name])

    async def stop(self, name: str, sig: int, timeout: float) -> Container:  # noqa: ASYNC109
        c = self.get(name)
        async with c.lock:
            await self._stop(c, sig, timeout)
            return c

    async def _stop(self, c: Container, sig: int, timeout: float) -> None:  # noqa: ASYNC109
        if c.status != RUNNING:
            return
        for s in (sig, signal.SIGKILL):
            await _proc.run(self.reaper, [*self.crun, "kill", c.name, str(s)])
            try:
                await asyncio.wait_for(c.ended.wait(), timeout)
                return
            except TimeoutError:
                timeout = 5.0
        if c.child is not None:  # crun did not pass the kill on: end crun itself
            c.child.signal(signal.SIGKILL)
            await c.ended.wait()

    async def delete(self, name: str) -> None:
        c = self.get(name)
        async with c.lock:
            await self._stop(c, signal.SIGKILL, 5.0)
            _unmount_under(c.dir)
            gone = c.dir + ".deleting"
            os.rename(c.dir, gone)
            del self._all[name]
            await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, gone, True)

    async def stop_all(self, timeout: float) -> None:  # noqa: ASYNC109
        await asyncio.gather(*(self.stop(c.name, signal.SIGTERM, timeout) for c in self.all()),
                             return_exceptions=True)  # fmt: skip

    async def wait_made(self, name: str, within: float = 10.0) -> None:
        """Until crun has made the running container (its state file), which `crun run` does
        after the start has answered: an exec right after the start would find no container
        (`crun exec`: "error opening file .../status"). Returns at once once it is there, and
        when the container no longer runs (exec then says why)."""
        status = os.path.join(self.crun_root, name, "status")
        deadline = time.monotonic() + within
        while self._all.get(name) is not None and self._all[name].status == RUNNING:
            if os.path.exists(status) or time.monotonic() > deadline:  # noqa: ASYNC240 (tmpfs)
                return
            await asyncio.sleep(0.01)

    async def exec(
        self, name: str, argv: list[str], env: list[str], stdin: bool, *, cwd: str = "",
        terminal: tuple[int, int] | None = None,
    ) -> tuple[_proc.Child, int | None, int, int]:  # fmt: skip
        """A process in the running container, as docker exec runs one (_oci.exec_process):
        (child, its stdin's write end, stdout, stderr). With a terminal of (rows, columns),
        stdin and stdout are the terminal's master (stdin always: a terminal has one) and
        stderr carries crun's own errors."""
        c = self.get(name)
        if c.status != RUNNING:
            raise FeosError(
                Code.FAILED_PRECONDITION, f"container {name} is {c.status}, not running"
            )
        os.makedirs(self.exec_dir, exist_ok=True)
        self._execs += 1
        stem = os.path.join(self.exec_dir, f"{name}.{os.getpid()}.{self._execs}")
        process = _oci.exec_process(_process(c.dir), argv, env, cwd, terminal)
        gate = self._size_gate() if terminal is not None else None
        if gate is not None:
            process["args"] = [*SIZE_GATE_ARGV, *process["args"]]
        write_whole(f"{stem}.json", json.dumps(process).encode(), sync=False)
        try:
            if terminal is not None:
                made = await self._exec_tty(name, stem, gate)
            else:
                made = self._exec_pipes(name, stem, stdin)
        except BaseException:
            _unlink(f"{stem}.json")
            raise
        # crun reads it when it likes: it goes with crun
        made[0].exited.add_done_callback(lambda _: _unlink(f"{stem}.json"))
        return made

    def _exec_pipes(self, name: str, stem: str, stdin: bool) -> tuple[Any, ...]:
        cmd = [*self.crun, "exec", f"--process={stem}.json", name]
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if stdin else (None, None)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            child = self.reaper.spawn(cmd, stdin=in_r, stdout=out_w, stderr=err_w)
        finally:
            for fd in (in_r, out_w, err_w):
                if fd is not None:
                    os.close(fd)
        return child, in_w, out_r, err_r

    async def _exec_tty(self, name: str, stem: str, gate: int | None) -> tuple[Any, ...]:
        """crun makes the terminal in the container and hands its master over a console socket
        (SCM_RIGHTS) before it waits for the process; a crun that fails first says why on its
        stderr, and the wait for the master ends with it.

        crun's child runs the process while its parent sets the terminal's size, then sends
        the master: a process that asks for its size at once (stty size, a shell's first
        prompt) could see 0 x 0. With a gate (_size_gate), the process is the gate's shell
        first, reading its fd 4 until the master is here, and so the size set."""
        import socket  # not on the agent's start path

        path = f"{stem}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        held_r, held_w = os.pipe2(os.O_CLOEXEC) if gate is not None else (None, None)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            cmd = [*self.crun, "exec", f"--process={path[:-5]}.json",
                   f"--console-socket={path}", name]  # fmt: skip
            extra: tuple[int, ...] = ()
            if gate is not None and held_r is not None:
                cmd[len(self.crun) + 1:len(self.crun) + 1] = ["--preserve-fds=2"]
                extra = (gate, held_r)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            try:
                child = self.reaper.spawn(cmd, stderr=err_w, extra=extra)
            finally:
                os.close(err_w)
                if held_r is not None:
                    os.close(held_r)
            master = await _receive_master(listener, child, err_r)
        finally:
            listener.close()
            _unlink(path)
            if held_w is not None:
                os.close(held_w)  # the size is set: the gate lets the process run
        return child, os.dup(master), master, err_r

    def _size_gate(self) -> int | None:
        """An O_PATH fd of a directory holding a statically linked busybox and nothing else,
        for SIZE_GATE_ARGV (the process reaches it as /proc/self/fd/3/busybox: no library of
        the image's is needed, and nothing else of the guest's files is in reach). None where
        there is no static busybox: the process then starts at once, as crun starts it."""
        if self._gate is None:
            self._gate = _make_size_gate(os.path.join(self.exec_dir, "gate"))
        return self._gate if self._gate >= 0 else None


async def _receive_master(listener: Any, child: _proc.Child, err_r: int) -> int:
    import socket

    loop = asyncio.get_running_loop()
    accept: asyncio.Future[Any] = asyncio.ensure_future(loop.sock_accept(listener))
    await asyncio.wait([accept, child.exited], timeout=EXEC_TTY_WITHIN,
                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    if not accept.done():
        accept.cancel()
        child.signal(signal.SIGKILL)
        why = (await _proc.read_fd(err_r)).decode("utf-8", "replace").strip()
        raise FeosError(Code.FAILED_PRECONDITION, f"exec with a terminal: {why or 'no terminal'}")
    conn, _ = accept.result()
    with conn:
        conn.setblocking(True)  # crun sends the fd as soon as it has connected
        _, fds, _, _ = socket.recv_fds(conn, 16, 1, socket.MSG_CMSG_CLOEXEC)
    if not fds:
        raise FeosError(Code.INTERNAL, "exec with a terminal: crun sent no terminal")
    return fds[0]


EXEC_TTY_WITHIN = 10.0  # for crun to hand the terminal over

# An exec with a terminal runs as `busybox sh -c GATE feos-exec ARGV...`: its fd 4 ends once the
# terminal has its size, then the gate's fds are closed and ARGV runs in the shell's place.
SIZE_GATE_ARGV = ("/proc/self/fd/3/busybox", "sh", "-c",
                  'read -r _ <&4; exec 3<&- 4<&-; exec "$@"', "feos-exec")  # fmt: skip


def _make_size_gate(directory: str) -> int:
    """_size_gate's directory made (busybox linked or copied in), opened O_PATH; -1 where
    there is no statically linked busybox on PATH."""
    found = shutil.which("busybox")
    if found is None or not _is_static(found):
        return -1
    inside = os.path.join(directory, "busybox")
    if not os.path.exists(inside):
        os.makedirs(directory, mode=0o755, exist_ok=True)
        partial = inside + ".partial"
        shutil.copyfile(found, partial)
        os.chmod(partial, 0o755)
        os.replace(partial, inside)
    return os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _is_static(path: str) -> bool:
    """Whether the ELF file at path has no program interpreter (PT_INTERP): it runs in any
    container, whatever libraries its image has."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only: the guests are
                return False
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except (OSError, struct.error):
        return False
    types = [struct.unpack_from("<I", table, i * phentsize)[0] for i in range(phnum)]
    return len(table) == phentsize * phnum and 3 not in types  # 3: PT_INTERP


def _mount_rootfs(rootfs: str, lowers: list[str]) -> str | None:
    """An overlayfs at rootfs: the layers' directories (lowest first) under the container's
    own upper/ beside it (work/ its scratch). None once mounted, else why not."""
    import ctypes

    bundle = os.path.dirname(rootfs)
    upper, work = os.path.join(bundle, "upper"), os.path.join(bundle, "work")
    os.makedirs(upper, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    if not lowers:  # an image of no layers: overlayfs wants a lower all the same
        lowers = [os.path.join(bundle, "empty")]
        os.makedirs(lowers[0], exist_ok=True)
    options = f"lowerdir={':'.join(reversed(lowers))},upperdir={upper},workdir={work}"
    if len(options) >= 4000:  # a mount's options fit in a page
        return f"{len(lowers)} layers are too many for one mount"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"overlay", rootfs.encode(), b"overlay", 0, options.encode()) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _unmount_under(path: str) -> None:
    """Every mount at or under path detached (a container's rootfs), deepest first."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    inside = [p for p in points if p == path or p.startswith(path.rstrip("/") + "/")]
    if not inside:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(inside, key=len, reverse=True):
        libc.umount2(point.encode(), 2)  # MNT_DETACH


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _process(directory: str) -> dict[str, Any]:
    """The container's own process (its bundle's config.json): what an exec starts from."""
    try:
        with open(os.path.join(directory, "bundle", "config.json"), "rb") as f:
            return dict(json.load(f)["process"])
    except (OSError, ValueError, KeyError, TypeError):
        return {"user": {"uid": 0, "gid": 0}, "env": [], "cwd": "/"}


def _check_command(rootfs: str, arg0: str, env: list[str], cwd: str, mounts: list[str],
                   config: dict[str, Any]) -> None:  # fmt: skip
    """A command the container could not run fails its create, as docker's does, rather than a
    start that answers and a container that exits 127 at once. One that may be on a volume
    (mounted at start, not there yet) is left to the start."""
    paths = _oci.command_paths(arg0, env, cwd)
    if any(p == m or p.startswith(m.rstrip("/") + "/") for p in paths for m in mounts):
        return
    if any(_executable_in(rootfs, p) for p in paths):
        return
    where = "" if "/" in arg0 else " in its PATH"
    raise FeosError(Code.INVALID_ARGUMENT, f"command {arg0!r} is not an executable file{where} "
                    f"in image {config['image']}")  # fmt: skip


def _executable_in(rootfs: str, path: str, hops: int = 40) -> bool:
    """Whether path, resolved inside rootfs as the container sees it (symlinks, absolute or
    relative, never above its root), is an executable regular file."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == "..":
            done = done[:-1]
            continue
        here = os.path.join(rootfs, *done, part)
        try:
            st = os.lstat(here)
        except OSError:
            return False
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return False  # a loop: ELOOP to the container too
            target = os.readlink(here)
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            if target.startswith("/"):
                done = []
            continue
        done.append(part)
    try:
        st = os.stat(os.path.join(rootfs, *done))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)


def _read(rootfs: str, rel: str) -> str:
    try:
        with open(os.path.join(rootfs, rel), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def state_dict(c: Container) -> dict[str, Any]:
    r = c.record
    return {"name": c.name, "image": r["config"]["image"], "imageDigest": r.get("imageDigest", ""),
            "status": r["status"], "pid": int(r.get("pid") or 0),
            "exitCode": int(r.get("exitCode", 0)),
            "createdNs": int(r.get("createdNs", 0)), "startedNs": int(r.get("startedNs", 0)),
            "finishedNs": int(r.get("finishedNs", 0))}  # fmt: skip


def _machine_id_in(rootfs: str, spec: dict[str, Any], source: str) -> None:
    """The pod's machine ID bound over the image's /etc/machine-id (a file to bind onto)."""
    target = os.path.join(rootfs, "etc", "machine-id")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(target) or not os.path.isfile(target):
        try:
            os.unlink(target)
        except (FileNotFoundError, IsADirectoryError):
            pass
        open(target, "a").close()
    spec["mounts"].append({"destination": "/etc/machine-id", "type": "bind", "source": source,
                           "options": ["bind", "ro", "nosuid", "nodev"]})

