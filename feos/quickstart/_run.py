"""One run of the quickstart, from nothing (or from what an earlier run left) to a served page.

The order, each step finding what is there before it makes anything:

1. the registry: its namespace and docker-registry (_registry), then the demo image's OCI layout
   (_image), pushed with skopeo only when the registry lacks its digest;
2. the prefix: `--pod-prefix` among feosd's arguments, else the one kept in the quickstart's
   directory (made once, _prefix);
3. diskd and feosd: the feosd serving on the run directory's socket, else diskd (on
   <state>/disk, unless one serves there) and then feosd started here with the prefix
   (and `--web 127.0.0.1:PORT` when this feosd has a web console: see WEB below);
4. the demo pod (_demo), its page fetched on 127.0.0.1, then the summary printed;
5. waiting for Ctrl-C or SIGTERM (or feosd's end), then the stop: the pod stopped (its record
   and disk kept), feosd stopped, the registry's process ended and its namespace removed (its
   data kept). What stays is printed. A feosd this run did not start is left as it was, with the
   pod.
"""

from __future__ import annotations

import ipaddress
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs

from . import _demo, _feosd, _image, _prefix, _registry
from ._feosd import Node


class Stop(BaseException):
    """SIGINT or SIGTERM arrived: stop in order (raised by the handler, caught by run)."""


@attrs.frozen
class Options:
    directory: Path
    port: int
    web_port: int
    feosd_args: tuple[str, ...]

    @property
    def quickstart_dir(self) -> Path:
        return self.directory / "quickstart"

    def node(self) -> Node:
        state = Path(os.environ.get("FEOS_STATE_DIR") or self.directory / "state")
        run = Path(os.environ.get("FEOS_RUN_DIR") or self.directory / "run")
        return Node(state.resolve(), run.resolve(), self.quickstart_dir / "feosd.log")


def say(text: str) -> None:
    print(f"quickstart: {text}", file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


def run(opts: Options) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    opts.quickstart_dir.mkdir(parents=True, exist_ok=True)
    node = opts.node()
    reg = _registry.registry_for(opts.quickstart_dir)
    feosd: subprocess.Popen[bytes] | None = None
    diskd: subprocess.Popen[bytes] | None = None
    try:
        image = _image_ready(opts, reg)
        if not _feosd.serving(node):
            diskd = _feosd.start_diskd(node)
            say(f"diskd: {'started' if diskd else 'found serving'} on {_feosd.diskd_socket(node)}")
        feosd, web = _feosd_ready(opts, node)
        pod, done = _demo.bring_up(node, image, opts.port)
        say(f"the demo pod {_demo.POD_ID}: {done}")
        port = _demo.published_port(pod)
        page = _demo.wait_page(port)
        _summary(node, pod, port, page, web)
        _wait(feosd)
    except Stop as stop:
        say(f"{stop.args[0]}: stopping")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        _teardown(node, reg, feosd)
        if diskd is not None:  # after feosd: its pods' disks are diskd's
            say(f"stopping diskd (exit {_feosd.stop(diskd)})")
    return 0


def _image_ready(opts: Options, reg: _registry.Registry) -> str:
    found = _registry.ensure(reg)
    say(f"registry {reg.host}: {'found running' if found else 'started'} "
        f"(namespace {reg.namespace}, data in {reg.data})")
    digest = _image.write_layout(opts.quickstart_dir / "image")
    if _image.pushed_digest(reg.host) == digest:
        say(f"demo image {_image.reference(reg.host)}: already in the registry")
    else:
        _image.push(opts.quickstart_dir / "image", reg.host)
        say(f"demo image {_image.reference(reg.host)}: pushed with skopeo ({digest[:19]})")
    return _image.reference(reg.host)


def _feosd_ready(opts: Options, node: Node) -> tuple[subprocess.Popen[bytes] | None, str | None]:
    """feosd serving, and its web console's address (None: none, or not known)."""
    if _feosd.serving(node):
        say(f"feosd: found serving on {node.socket} (not started here: it stays running)")
        return None, None
    args = list(opts.feosd_args)
    if "--pod-prefix" not in args:
        prefix, made = _prefix.kept_prefix(opts.quickstart_dir / "prefix")
        say(f"pod prefix {prefix}: {'made now (RFC 4193)' if made else 'kept from before'}")
        args += ["--pod-prefix", str(prefix)]
    web_args, web = _web(opts)
    say(f"feosd: starting (log {node.log})")
    return _feosd.start(node, args + web_args), web


def _web(opts: Options) -> tuple[list[str], str | None]:
    """WEB: the web console. When this feosd has one (`feosd --help` lists --web), the
    quickstart turns it on on loopback at --web-port, unless feosd's arguments give --web
    themselves; _summary prints its address. A feosd without --web gets nothing."""
    given = list(opts.feosd_args)
    if "--web" in given[:-1]:
        return [], f"http://{given[given.index('--web') + 1]}/"
    if not _feosd.has_option("--web"):
        return [], None
    address = f"127.0.0.1:{opts.web_port}"
    return ["--web", address], f"http://{address}/"


def node_addresses() -> list[str]:
    """The node's global addresses on the interface of its default route (read, none sent)."""
    found: list[str] = []
    for family in ("-4", "-6"):
        routes = json.loads(_ip(family, "-j", "route", "show", "default") or "[]")
        for route in routes[:1]:
            addrs = json.loads(_ip(family, "-j", "addr", "show", "dev", route["dev"],
                                   "scope", "global") or "[]")
            found += [a["local"] for link in addrs for a in link.get("addr_info", [])[:1]]
    return found


def _ip(*argv: str) -> str:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10).stdout


def urls(port: int) -> list[str]:
    hosts = ["127.0.0.1", "::1", *node_addresses()]
    return [f"http://{_bracket(h)}:{port}/" for h in hosts]


def _bracket(host: str) -> str:
    return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host


def _summary(node: Node, pod: dict[str, Any], port: int, page: str, web: str | None) -> None:
    ctl = f"{_feosd.BIN / 'feosctl'} --socket {node.socket}"
    lines = ["", f"The demo pod {_demo.POD_ID} is running and answers: {page}",
             f"  its addresses:   {pod.get('ipv6Address', '')}  {pod.get('ipv4Address', '')}",
             "  published by the node (from this machine):"]
    lines += [f"    {url}" for url in urls(port)]
    lines += ["  try:", f"    {ctl} pod get {_demo.POD_ID}",
              f"    {ctl} pod exec {_demo.POD_ID} -- cat /www/index.html",
              f"    {ctl} pod events"]
    if web:
        lines.append(f"  the web console: {web}")
    lines += ["Ctrl-C stops it: the pod is stopped (kept), then feosd and the registry.", ""]
    print("\n".join(lines), flush=True)


def _wait(feosd: subprocess.Popen[bytes] | None) -> None:
    """Until a signal (the handler raises Stop) or the end of the feosd started here."""
    if feosd is None:
        while True:
            signal.pause()
    fd = os.pidfd_open(feosd.pid)
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
    say(f"feosd ended by itself (exit {feosd.wait()}): see its log")


def _teardown(node: Node, reg: _registry.Registry, feosd: subprocess.Popen[bytes] | None) -> None:
    stays = [f"the state directory {node.state_dir} (feosd's records and disks)",
             f"the prefix, the registry's data and the demo image in {reg.data.parent} "
             "(the next run pushes nothing)"]
    if feosd is not None:
        if feosd.poll() is None:
            say(f"stopping the demo pod {_demo.POD_ID} (its record and disk stay)")
            _feosd.ctl(node, "pod", "stop", _demo.POD_ID, check=False, timeout=120)
        say(f"stopping feosd (exit {_feosd.stop(feosd)})")
        stays.insert(0, f"the pod {_demo.POD_ID}, stopped, not suspended (it holds no process "
                        "or memory with feosd gone): the next run starts it again")
    else:
        stays.insert(0, f"feosd on {node.socket} and its pods, as found: not started here")
    _registry.stop(reg)
    say(f"registry stopped, namespace {reg.namespace} removed")
    say("what stays: " + "; ".join(stays))
