"""The OCI runtime config.json of a container, without I/O.

Containers share the guest's network (the microVM is the pod): no network namespace. The guest's
resolv.conf is bind-mounted read-only at /etc/resolv.conf, so a new network configuration reaches
running containers too (the agent rewrites that file in place).
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy takes it as true; typing (and the re it imports) costs the start
if TYPE_CHECKING:
    from typing import Any

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]  # fmt: skip


def process_args(command: list[str], image_config: dict[str, Any]) -> list[str]:
    """The node's command, else the image's entrypoint and cmd."""
    if command:
        return list(command)
    args = list(image_config.get("Entrypoint") or []) + list(image_config.get("Cmd") or [])
    return args or ["/bin/sh"]


def command_paths(arg0: str, env: list[str], cwd: str) -> list[str]:
    """Where a process's argv[0] is looked for, in order, as absolute paths in the container:
    itself if it has a slash (relative to cwd), else each directory of the environment's PATH,
    as execvp(3) searches it."""
    if "/" in arg0:
        return [_join(cwd, arg0)]
    path = next((e[5:] for e in env if e.startswith("PATH=")), DEFAULT_PATH[5:])
    return [_join(_join(cwd, d or "."), arg0) for d in path.split(":")]


def _join(base: str, rel: str) -> str:
    return rel if rel.startswith("/") else base.rstrip("/") + "/" + rel


def merge_env(image_env: list[str], env: list[str]) -> list[str]:
    """The image's environment, then the node's over it (a key keeps its first place)."""
    merged: dict[str, str] = {}
    for item in [DEFAULT_PATH, *image_env, *env]:
        key, _, _ = item.partition("=")
        merged[key] = item
    return list(merged.values())


def user_ids(user: str, passwd: str, group: str) -> tuple[int, int]:
    """uid and gid of an image's User ("", "name", "uid", "uid:gid", "name:group")."""
    name, _, grp = (user or "0").partition(":")
    uid, gid = _lookup(name, passwd, 2, 3)
    if grp:
        gid = _lookup(grp, group, 2, 2)[0]
    return uid, gid


def _lookup(name: str, table: str, id_col: int, gid_col: int) -> tuple[int, int]:
    if name.isdigit():
        return int(name), int(name) if id_col == gid_col else 0
    for line in table.splitlines():
        cols = line.split(":")
        if len(cols) > max(id_col, gid_col) and cols[0] == name:
            return int(cols[id_col]), int(cols[gid_col])
    if name == "root":
        return 0, 0
    raise ValueError(f"user or group {name!r} is not in the image")


def config(
    *,
    hostname: str,
    args: list[str],
    env: list[str],
    cwd: str,
    uid: int,
    gid: int,
    resolv_conf: str,
    binds: list[tuple[str, str, bool]],
) -> dict[str, Any]:
    """binds: (source on the guest, destination in the container, read-only)."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777"]},
        {"destination": "/etc/resolv.conf", "type": "bind", "source": resolv_conf,
         "options": ["rbind", "ro", "nosuid", "nodev"]},
    ]  # fmt: skip
    for source, dest, read_only in binds:
        options = ["rbind", "nosuid", "nodev"] + (["ro"] if read_only else ["rw"])
        mounts.append({"destination": dest, "type": "bind", "source": source, "options": options})
    return {
        "ociVersion": "1.0.2",
        "hostname": hostname,
        "root": {"path": "rootfs", "readonly": False},
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": args,
            "env": env,
            "cwd": cwd or "/",
            "noNewPrivileges": True,
            "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
        },
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": [
                "/proc/bus",
                "/proc/fs",
                "/proc/irq",
                "/proc/sys",
                "/proc/sysrq-trigger",
            ],
        },
    }


DEFAULT_TERMINAL = (24, 80)  # rows, columns: a terminal whose size the caller did not give


def exec_process(
    base: dict[str, Any], args: list[str], env: list[str], cwd: str,
    terminal: tuple[int, int] | None,
) -> dict[str, Any]:  # fmt: skip
    """`crun exec --process`'s process.json for a process in a running container, as docker
    exec makes it: the container's own process (its user, capabilities, rlimits, environment
    and working directory) with args, env over its environment, cwd (when given) for its
    directory, and a terminal of (rows, columns) (0: the default) when one is asked for."""
    process = dict(base)
    process.update(args=args, env=merge_env(list(base.get("env") or []), env),
                   cwd=cwd or str(base.get("cwd") or "/"), terminal=terminal is not None)
    process.pop("consoleSize", None)
    if terminal is not None:
        rows, cols = terminal
        process["consoleSize"] = {"height": rows or DEFAULT_TERMINAL[0],
                                  "width": cols or DEFAULT_TERMINAL[1]}  # fmt: skip
    return process
