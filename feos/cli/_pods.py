"""feosctl pod: create, list, get, start, stop, delete, suspend, resume, exec, logs, events
(hibernate and restore: _hibernate.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import sys
import time
from typing import Any

import capnp

from ..errors import Code, FeosError
from ..rpc import Client, raise_for_status
from ._commands import Table, UsageError, _noun, _verb, load_file, parse_size

POD_COLUMNS = ["ID", "STATE", "STEP/REASON", "VCPUS", "MEMORY", "IPV6", "IPV4", "CONTAINERS"]


def pod_row(p: dict[str, Any]) -> list[str]:
    spec = p.get("spec", {})
    detail = p.get("reason", "") or (p.get("step", "") if p.get("state") == "pending" else "")
    names = ",".join(c.get("name", "") for c in spec.get("containers", []))
    return [p.get("id", ""), p.get("state", ""), detail, str(spec.get("vcpus", "")),
            f"{spec.get('memoryMib', '')}MiB", p.get("ipv6Address", "") or "-",
            p.get("ipv4Address", "") or "-", names]


_PUBLISH = re.compile(r"(?:(?P<addr>\[[0-9A-Fa-f:.]+\]|[0-9.]+):)?(?P<host>[0-9]+):(?P<pod>[0-9]+)"
                      r"(?:/(?P<proto>tcp|udp))?\Z")
PUBLISH_FORM = "[ADDRESS:]HOSTPORT:PODPORT[/tcp|/udp]"


def parse_publish(text: str) -> dict[str, Any]:
    """--publish as docker and podman take it, as a PublishedPort's dict (the schema's names).
    No ADDRESS: every address of the node, both families; an IPv6 address goes in brackets.
    The numbers and the address are checked by feosd, which names the field."""
    m = _PUBLISH.match(text.strip())
    if m is None:
        raise UsageError(f"--publish {text!r}: give {PUBLISH_FORM}, such as 8080:80, "
                         "127.0.0.1:8080:80 or [::1]:5353:53/udp")
    return {"protocol": m["proto"] or "tcp", "hostAddress": (m["addr"] or "").strip("[]"),
            "hostPort": int(m["host"]), "podPort": int(m["pod"])}


def _with_publish(spec: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """The spec's network.pod.publish with each text item parsed and --publish added."""
    network = spec.get("network")
    if isinstance(network, dict) and "none" in network:
        if extra:
            raise UsageError("--publish needs a pod with a network (not --no-network)")
        return spec
    network = dict(network) if isinstance(network, dict) else {}
    pod = dict(network.get("pod") or {})
    items = list(pod.get("publish") or []) + extra
    if not items:
        return spec
    pod["publish"] = [parse_publish(i) if isinstance(i, str) else i for i in items]
    network["pod"] = pod
    return {**spec, "network": network}


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return _with_publish(_spec_from_args(args), list(getattr(args, "publish", None) or []))


def _spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.file:
        loaded = load_file(args.file)
        if not isinstance(loaded, dict):
            raise UsageError(
                f"{args.file}: a pod spec is a mapping (vcpus, memoryMib, containers...)")
        if "spec" in loaded and "id" in loaded:
            return dict(loaded["spec"])
        return loaded
    if not args.image:
        raise UsageError("pod create: give a spec file (-f FILE) or --image")
    spec: dict[str, Any] = {
        "vcpus": args.cpus,
        "memoryMib": parse_size(args.memory) >> 20,
        "containers": [{"name": args.name, "image": args.image,
                        "command": args.cmd or [],
                        "env": [{"key": k, "value": v} for k, _, v in
                                (e.partition("=") for e in args.env)],
                        "volumeMounts": [{"volume": n, "path": path} for n, path in
                                         (m.split(":", 1) for m in args.mount)]}],
        "volumes": [{"name": n, "volumeId": v} for n, v in (x.split("=", 1) for x in args.volume)],
        "network": {"none": None} if args.no_network else {"pod": {
            "securityGroups": args.group, "nameTables": args.names, "dnsUpstreams": args.dns}},
    }
    return spec


async def wait_settled(client: Client, pod_id: str, quiet: bool) -> dict[str, Any]:
    """Follow the pod's events until it is RUNNING or FAILED. Unless quiet, each bring-up
    step (disk, vm, guest, volumes, containers) is a line on stderr as it begins, with the
    time since the wait began, and the last line is the state it settled in and its reason."""
    watch = await client.call("pods", "watchEvents", podId=pod_id)
    stream = watch.stream
    pod = (await client.call("pods", "getPod", id=pod_id)).pod.to_dict()
    progress = Progress(pod_id, quiet)
    while pod.get("state") == "pending":
        progress.step(pod.get("step", ""))
        answer = await pull(stream.next(max=64), "event")
        for event in answer.events:
            pod["state"], pod["step"], pod["reason"] = event.state, event.step, event.reason
            if event.state == "pending":
                progress.step(event.step)
        if answer.end:
            break
    pod = (await client.call("pods", "getPod", id=pod_id)).pod.to_dict()
    progress.settled(pod.get("state", ""), pod.get("reason", ""))
    return pod


class Progress:
    """The --wait lines: one a step, each once, then the settled state."""

    def __init__(self, pod_id: str, quiet: bool, out: Any = None) -> None:
        self.pod_id, self.quiet = pod_id, quiet
        self.out = out
        self.started = time.monotonic()
        self.last = ""

    def line(self, text: str) -> None:
        if not self.quiet:
            took = time.monotonic() - self.started
            print(f"pod {self.pod_id}: {text} ({took:.1f}s)", file=self.out or sys.stderr,
                  flush=True)  # fmt: skip

    def step(self, step: str) -> None:
        if step and step != self.last:
            self.last = step
            self.line(step)

    def settled(self, state: str, reason: str) -> None:
        self.line(f"{state}: {reason}" if reason else state)


def _new_pod_id() -> str:
    # Only when the command line names no ID: feos.pods loads the network's modules, 0.15 s of
    # feosctl's start that a create with an ID would wait for.
    from ..pods import new_pod_id

    return new_pod_id()


def id_from_file(args: argparse.Namespace) -> str:
    """The ID of a spec file of the form {id, spec}, when the command line names none."""
    if args.id or not args.file:
        return args.id or ""
    document = load_file(args.file)
    if isinstance(document, dict) and isinstance(document.get("id"), str) and "spec" in document:
        return document["id"]
    return ""


async def pod_create(client: Client, args: argparse.Namespace) -> Table:
    spec = spec_from_args(args)
    pod_id = id_from_file(args) or _new_pod_id()
    r = await client.call("pods", "createPod", id=pod_id, spec=spec,
                          pullToken=args.pull_token or "", **image_layers(args, spec))
    pod = r.pod.to_dict()
    if args.wait:
        pod = await wait_settled(client, pod_id, args.json)
        if pod.get("state") == "failed":
            raise FeosError(Code.FAILED_PRECONDITION,
                            f"pod {pod_id} failed: {pod.get('reason', '')}")
    return Table(pod, POD_COLUMNS, [pod_row(pod)])


def image_layers(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """createPod's imageLayers from --layer and --bake, for the image of the pod's one container."""
    if not args.layer and not args.bake:
        return {}
    images = [c.get("image", "") for c in spec.get("containers", [])]
    if len(images) != 1:
        raise UsageError("--layer and --bake need a pod of one container")
    return {"imageLayers": {"image": images[0], "layers": list(args.layer),
                            "mayBake": bool(args.bake)}}


async def pod_list(client: Client, args: argparse.Namespace) -> Table:
    pods = [p.to_dict() for p in (await client.call("pods", "listPods")).pods]
    return Table(pods, POD_COLUMNS, [pod_row(p) for p in pods])


async def pod_get(client: Client, args: argparse.Namespace) -> Table:
    pod = (await client.call("pods", "getPod", id=args.id)).pod.to_dict()
    rows = [pod_row(pod)]
    table = Table(pod, POD_COLUMNS, rows)
    for c in pod.get("containers", []):
        rows.append(["", f"container {c.get('name')}", c.get("state", ""), "", "", "", "",
                     f"exit {c.get('exitCode', 0)}" if c.get("state") == "exited" else ""])
    for p in (pod.get("spec", {}).get("network", {}).get("pod") or {}).get("publish", []):
        rows.append(["", "publish", publish_text(p), "", "", "", "", ""])
    if pod.get("checkpoint"):
        rows.append(["", "checkpoint", pod["checkpoint"], "", "", "", "", ""])
    if h := pod.get("hibernation"):
        moved = f"{h.get('bytesDone', 0) >> 20}/{h.get('bytesTotal', 0) >> 20} MiB"
        rows.append(["", "hibernation", h.get("phase", ""), moved, "", "", "", ""])
    return table


def publish_text(p: dict[str, Any]) -> str:
    """A PublishedPort's dict as --publish takes it (the wire leaves empty fields out)."""
    host = p.get("hostAddress", "")
    host = f"[{host}]:" if ":" in host else f"{host}:" if host else ""
    return f"{host}{p.get('hostPort', 0)}:{p.get('podPort', 0)}/{p.get('protocol') or 'tcp'}"


def _change(method: str):  # type: ignore[no-untyped-def]
    async def change(client: Client, args: argparse.Namespace) -> Table | str:
        params: dict[str, Any] = {"id": args.id}
        if method == "startPod" and getattr(args, "pull_token", None):
            params["pullToken"] = args.pull_token
        r = await client.call("pods", method, **params)
        if method == "deletePod":
            return f"pod {args.id} deleted"
        pod = r.pod.to_dict()
        if method == "startPod" and args.wait:
            pod = await wait_settled(client, args.id, args.json)
        return Table(pod, POD_COLUMNS, [pod_row(pod)])

    return change


async def pull(promise: Any, what: str) -> Any:
    """A stream's next answer, its status checked: a failed stream ends the command."""
    try:
        return raise_for_status(await promise)
    except capnp.KjException as exc:
        raise FeosError(Code.UNAVAILABLE, f"the {what} stream broke: {exc.description}") from None


async def _pump(stream: Any, out: Any, err: Any) -> int:
    while True:
        r = await pull(stream.read(), "output")
        if r.stdout:
            out.write(bytes(r.stdout))
            out.flush()
        if r.stderr:
            err.write(bytes(r.stderr))
            err.flush()
        if r.exited:
            return int(r.exitCode)


async def _feed_stdin(stream: Any) -> None:
    if os.isatty(sys.stdin.fileno()):
        return await _feed_terminal(stream, sys.stdin.fileno())
    loop = asyncio.get_running_loop()
    while True:
        stdin = sys.stdin.buffer
        read = stdin.read1 if isinstance(stdin, io.BufferedReader) else stdin.read
        data = await loop.run_in_executor(None, read, 65536)
        await stream.write(data=data, close=not data)
        if not data:
            return


async def _feed_terminal(stream: Any, fd: int) -> None:
    """A terminal's keys as they come, read when the loop sees them ready: no thread is left
    blocked in a read when the command ends (asyncio.run would wait for it, for a key)."""
    loop = asyncio.get_running_loop()
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _ready, ready)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        data = os.read(fd, 65536)
        await stream.write(data=data, close=not data)
        if not data:
            return


def _ready(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ExitWith(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _exec_flags(p: argparse.ArgumentParser, args: argparse.Namespace | None = None) -> None:
    """exec's flags, as docker exec's: on the verb, and again for those given after the ID."""
    def default(name: str, empty: Any) -> Any:
        return getattr(args, name) if args is not None else empty

    p.add_argument("-c", "--container", default=default("container", "main"))
    p.add_argument("-i", "--stdin", "--interactive", action="store_true",
                   default=default("stdin", False), help="pass stdin to the command")
    p.add_argument("-t", "--tty", action="store_true", default=default("tty", False),
                   help="give the command a terminal (this terminal's size; raw mode here)")
    p.add_argument("-w", "--workdir", default=default("workdir", ""), metavar="DIR",
                   help="the working directory (default: the container's)")
    p.add_argument("-e", "--env", action="append", default=list(default("env", [])),
                   metavar="KEY=VALUE", help="over the container's environment (repeatable)")


def exec_options(args: argparse.Namespace) -> list[str]:
    """The command, and the options given after the ID: `pod exec ID -it -e K=V -- CMD...`.

    The command takes the rest of the line (argparse.REMAINDER) from the first word after the
    ID, so options between the ID and `--` arrive in it; they are taken out here.
    """
    rest = list(args.command)
    if "--" not in rest or not rest[0].startswith("-"):
        return rest  # no options: `pod exec ID CMD...` (a -- further on is the command's)
    cut = rest.index("--")
    before, command = rest[:cut], rest[cut + 1:]
    if before:
        more = argparse.ArgumentParser(prog="feosctl pod exec", add_help=False)
        _exec_flags(more, args)
        try:
            given = more.parse_args(before)
        except SystemExit:
            raise UsageError(f"pod exec: {' '.join(before)}: not options of pod exec "
                             "(give the command after --)") from None
        for name in ("container", "stdin", "tty", "workdir", "env"):
            setattr(args, name, getattr(given, name))
    return command


def exec_request(args: argparse.Namespace, command: list[str],
                 size: tuple[int, int] = (0, 0)) -> dict[str, Any]:  # fmt: skip
    """ExecInPod's params: -e as KeyValues (checked here: feosd names the field of the rest),
    -w, and with -t a terminal of size (rows, columns; 0: feosd's 24 x 80)."""
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"pod exec: -e {item!r}: give KEY=VALUE")
        env.append({"key": key, "value": value})
    params: dict[str, Any] = {"id": args.id, "container": args.container, "command": command,
                              "env": env, "workingDir": args.workdir, "tty": args.tty}
    if args.tty:
        params["rows"], params["cols"] = size
    return params


def terminal_size() -> tuple[int, int]:
    """This terminal's (rows, columns), or (0, 0) when stdout is not a terminal."""
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, ValueError):
        return 0, 0
    return size.lines, size.columns


class RawTerminal:
    """stdin's terminal in raw mode (keys, ^C among them, go to the command's terminal as they
    are typed), given back as it was on any exit: an error, ^C's interrupt, the end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: list[Any] | None = None

    def __enter__(self) -> RawTerminal:
        import signal
        import termios
        import tty

        if os.isatty(self.fd):
            self.saved = termios.tcgetattr(self.fd)
            for sig in (signal.SIGTERM, signal.SIGHUP):  # given back first, not killed
                signal.signal(sig, self._signalled)
            tty.setraw(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        import termios

        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.saved = None

    def _signalled(self, sig: int, frame: Any) -> None:
        self.__exit__()
        raise SystemExit(128 + sig)


async def pod_exec(client: Client, args: argparse.Namespace) -> None:
    command = exec_options(args)
    if not command:
        raise UsageError("pod exec: give the command after --")
    params = exec_request(args, command, terminal_size() if args.tty else (0, 0))
    r = await client.call("pods", "execInPod", **params)
    stream = r.stream
    raw = RawTerminal(sys.stdin.fileno()) if args.tty else contextlib.nullcontext()
    with raw:
        code = await _exec_io(stream, args.stdin)
    if code:
        raise ExitWith(code)


async def _exec_io(stream: Any, stdin: bool) -> int:
    if stdin:
        feeder: asyncio.Future[None] | None = asyncio.ensure_future(_feed_stdin(stream))
    else:
        feeder = None
        await pull(stream.write(data=b"", close=True), "input")  # the command reads no stdin
    try:
        return await _pump(stream, sys.stdout.buffer, sys.stderr.buffer)
    finally:
        if feeder is not None:
            feeder.cancel()


async def pod_logs(client: Client, args: argparse.Namespace) -> None:
    r = await client.call("pods", "podLogs", id=args.id, container=args.container,
                          follow=args.follow)
    await _pump(r.stream, sys.stdout.buffer, sys.stderr.buffer)


async def pod_events(client: Client, args: argparse.Namespace) -> None:
    stream = (await client.call("pods", "watchEvents", podId=args.id or "")).stream
    while True:
        answer = await pull(stream.next(max=256), "event")
        for event in answer.events:
            e = event.to_dict()
            if args.json:
                print(json.dumps(e, sort_keys=True), flush=True)
            else:
                what = "deleted" if e.get("deleted") else e.get("state", "")
                detail = e.get("reason", "") or e.get("step", "")
                stamp = time.strftime("%H:%M:%S", time.localtime(e.get("timeUnixNs", 0) / 1e9))
                print(f"{stamp} #{e.get('sequence')} pod {e.get('podId')} {what} {detail}".rstrip(),
                      flush=True)
        if answer.end:
            return


def register_pod(nouns: Any) -> None:
    verbs = _noun(nouns, "pod", "pods: microVMs with containers inside")
    p = _verb(verbs, "create", pod_create, "create a pod from a spec file or from flags")
    p.add_argument("id", nargs="?", help="the pod's ID (default: a new one)")
    p.add_argument("-f", "--file", help="a PodSpec in JSON or YAML ('-': stdin)")
    p.add_argument("--image", help="the image of the pod's one container")
    p.add_argument("--name", default="main", help="the container's name (default main)")
    p.add_argument("--cmd", nargs=argparse.REMAINDER, help="the command, the rest of the line")
    p.add_argument("--cpus", type=int, default=1)
    p.add_argument("--memory", default="512MiB")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--volume", action="append", default=[], metavar="NAME=VOLUME_ID")
    p.add_argument("--mount", action="append", default=[], metavar="NAME:PATH")
    p.add_argument("--group", action="append", default=[], metavar="GROUP")
    p.add_argument("--names", action="append", default=[], metavar="TABLE")
    p.add_argument("--dns", action="append", default=[], metavar="ADDRESS")
    p.add_argument("--no-network", action="store_true", help="a pod without any network")
    p.add_argument("-p", "--publish", action="append", default=[], metavar=PUBLISH_FORM,
                   help="forward the node's port to the pod's, over IPv4 and IPv6 (repeatable; "
                        "no ADDRESS: every address of the node; an IPv4 or [IPv6] address "
                        "limits it; also network.pod.publish in a spec file)")
    p.add_argument("--pull-token", help="a Bearer token for the registry, for this bring-up only")
    p.add_argument("--layer", action="append", default=[], metavar="DIGEST",
                   help="a layer baked of the container's image to start the disk on, if diskd "
                        "has or fetches it (repeatable, best first)")
    p.add_argument("--bake", action="store_true",
                   help="let the pod bake its image into a layer if its disk starts blank")
    p.add_argument("--wait", action="store_true", help="block until RUNNING or FAILED")
    _verb(verbs, "list", pod_list, "list the pods")
    _verb(verbs, "get", pod_get, "show a pod, with its containers' states").add_argument("id")
    p = _verb(verbs, "start", _change("startPod"), "bring a stopped or failed pod up anew")
    p.add_argument("id")
    p.add_argument("--pull-token")
    p.add_argument("--wait", action="store_true")
    for verb, method, what in (("stop", "stopPod", "stop a pod (its disk stays)"),
                               ("delete", "deletePod", "delete a pod, its microVM and disk"),
                               ("suspend", "suspendPod", "suspend a pod to a snapshot"),
                               ("resume", "resumePod", "resume a suspended pod")):
        _verb(verbs, verb, _change(method), what).add_argument("id")
    p = _verb(verbs, "exec", pod_exec,
              "run a command in a container, as docker exec: pod exec ID [-it] -- CMD...")
    p.add_argument("id")
    _exec_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER)
    p = _verb(verbs, "logs", pod_logs, "a container's output")
    p.add_argument("id")
    p.add_argument("-c", "--container", default="main")
    p.add_argument("-f", "--follow", action="store_true")
    _verb(verbs, "events", pod_events, "follow the pods' events").add_argument("id", nargs="?")
    from ._hibernate import register as register_hibernate

    register_hibernate(verbs)
