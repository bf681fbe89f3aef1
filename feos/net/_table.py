"""The loader of the pods' table: libnftables (pip-nftables, ctypes), one transaction a call.

libnftables talks netlink from the network namespace its context was made in, and may reopen its
socket later from whatever thread calls it. A loader for another namespace (tests, the bench) so
runs every call on a short-lived thread that setns(2)'d into that namespace, never on a thread
of trio's pool: a pool thread left in another namespace would take the next caller's work there.
The loader for feosd's own namespace runs its calls on trio's worker threads. Calls are one at a
time (a trio.Lock): a context is not safe to share between concurrent calls.

TableWriter keeps the table loaded last and moves the kernel to a new one by the smallest change
(_nft.plan); a delta that the kernel refuses means the loaded table is not the one the delta was
made against (someone changed it), and the writer replaces it whole.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from feos import native
from feos.errors import Code, FeosError

from ._nft import TABLE, Change, Kind, Table, parse_log_prefix, plan, render_full

log = logging.getLogger(__name__)
T = TypeVar("T")


class NftLoader:
    """Runs nft scripts in one namespace: feosd's own (netns None) or a named one."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._lock = trio.Lock()
        self._fd: int | None = None
        if netns is not None:
            try:
                self._fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise FeosError(Code.FAILED_PRECONDITION, f"netns {netns}: {e.strerror}") from e
        self._nft: Any = None  # made on the first call, in the namespace, off trio's thread

    def close(self) -> None:
        """Let go of the context and the namespace (its socket holds the namespace alive)."""
        self._nft = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def run(self, script: str, *, code: Code = Code.INTERNAL) -> str:
        """Run `script` as one transaction; a refusal is FeosError(code) with nft's message."""
        async with self._lock:
            rc, out, err = await trio.to_thread.run_sync(self._in_ns, lambda: self._cmd(script))
        if rc != 0:
            raise FeosError(code, f"nftables refused the change: {err.strip() or f'rc {rc}'}")
        return str(out)

    async def read(self) -> list[dict[str, Any]]:
        """What is loaded of the table: nft's JSON listing, [] when there is no table."""
        async with self._lock:
            rc, out, err = await trio.to_thread.run_sync(
                self._in_ns, lambda: self._cmd(f"list table {TABLE}", json_output=True)
            )
        if rc != 0:
            if "No such file or directory" in err:
                return []
            raise FeosError(Code.INTERNAL, f"nftables: {err.strip()}")
        items: list[dict[str, Any]] = json.loads(out)["nftables"]
        return [i for i in items if "metainfo" not in i]

    def _cmd(self, script: str, *, json_output: bool = False) -> tuple[int, str, str]:
        if self._nft is None:
            self._nft = _new_context()
        self._nft.set_json_output(json_output)
        rc, out, err = self._nft.cmd(script)
        return int(rc), str(out), str(err)

    def _in_ns(self, fn: Callable[[], T]) -> T:
        """fn() in the loader's namespace, on a thread made for it there (see the docstring)."""
        if self._fd is None:
            return fn()
        fd, box, errors = self._fd, [], []

        def body() -> None:
            try:
                try:
                    native.setns(fd)
                except OSError as e:
                    raise FeosError(Code.FAILED_PRECONDITION, e.strerror or str(e)) from e
                box.append(fn())
            except BaseException as e:  # handed to the caller's thread
                errors.append(e)

        thread = threading.Thread(target=body, name=f"nft-{self.netns}")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return box[0]


def _new_context() -> Any:
    try:
        import nftables  # type: ignore[import-untyped]

        nft = nftables.Nftables()
    except (ImportError, OSError) as e:
        raise FeosError(Code.FAILED_PRECONDITION, f"libnftables is not usable: {e}") from e
    nft.set_handle_output(False)
    return nft


class TableWriter:
    """Moves the kernel's table to each new one by the smallest change, one transaction each."""

    def __init__(self, loader: NftLoader) -> None:
        self.loader = loader
        self.loaded: Table | None = None

    async def write(self, table: Table, *, full: bool = False) -> Kind:
        """Load `table`; `full` replaces it whole whatever changed. Returns what was done."""
        change = Change("full", render_full(table)) if full else plan(self.loaded, table)
        if change.kind == "none":
            return "none"
        try:
            await self.loader.run(change.script, code=_code(change))
        except FeosError as e:
            if change.kind == "full":
                raise
            log.warning("the pods' table: %s; replacing it whole", e.message)
            self.loaded = None
            await self.loader.run(render_full(table))
            change = Change("full", "")
        self.loaded = table
        return change.kind

    async def remove(self) -> None:
        await self.loader.run(f"table {TABLE} {{}}\ndelete table {TABLE}\n")
        self.loaded = None


def _code(change: Change) -> Code:
    return Code.INTERNAL if change.kind == "full" else Code.FAILED_PRECONDITION


async def run_table(
    writer: TableWriter,
    compile_now: Callable[[], Table],
    wakeups: trio.MemoryReceiveChannel[None],
    *,
    interval: float = 60.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The table's service: replace it at the start and every `interval`, which picks up new
    addresses of the node; on each wakeup (pods, groups or members changed) load the change.

    A failed write is logged and tried again at the next wakeup or interval: pods whose chains
    are not loaded have no rules, and from-pods drops their traffic (no-rule).
    """
    await _write_logged(writer, compile_now(), full=True)
    task_status.started()
    while True:
        full = False
        with trio.move_on_after(interval) as scope:
            await wakeups.receive()
        if scope.cancelled_caught:
            full = True
        await _write_logged(writer, compile_now(), full=full)


async def _write_logged(writer: TableWriter, table: Table, *, full: bool) -> None:
    try:
        await writer.write(table, full=full)
    except FeosError as e:
        log.error("the pods' table was not written: %s", e)


# ---- reading back --------------------------------------------------------------------------


def loaded_sets(listing: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each set's and map's elements as nft writes them (JSON texts), sorted."""
    out: dict[str, list[str]] = {}
    for item in listing:
        for kind in ("set", "map"):
            if kind in item:
                body = item[kind]
                out[body["name"]] = sorted(
                    json.dumps(e, sort_keys=True) for e in body.get("elem", [])
                )
    return out


def loaded_rules(listing: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each chain's rules (JSON of their expressions, counters zeroed), in order."""
    out: dict[str, list[str]] = {i["chain"]["name"]: [] for i in listing if "chain" in i}
    for item in listing:
        if "rule" in item:
            rule = item["rule"]
            exprs = [_zero_counter(e) for e in rule["expr"]]
            out[rule["chain"]].append(json.dumps(exprs, sort_keys=True))
    return out


def _zero_counter(expr: dict[str, Any]) -> dict[str, Any]:
    return {"counter": {"packets": 0, "bytes": 0}} if "counter" in expr else expr


def drop_counts(listing: list[dict[str, Any]]) -> dict[tuple[str, str, str | None], int]:
    """Packets dropped per (chain, reason, TAP of the prefix), from each drop's counter and the
    log prefix of the rule before it (every drop follows its log rule)."""
    counts: dict[tuple[str, str, str | None], int] = {}
    last_prefix: dict[str, str] = {}
    for item in listing:
        if "rule" not in item:
            continue
        rule = item["rule"]
        for expr in rule["expr"]:
            if "log" in expr and "prefix" in expr["log"]:
                last_prefix[rule["chain"]] = expr["log"]["prefix"]
            if "counter" in expr and rule["chain"] in last_prefix:
                parsed = parse_log_prefix(last_prefix[rule["chain"]])
                if parsed is not None:
                    key = (rule["chain"], *parsed)
                    counts[key] = counts.get(key, 0) + int(expr["counter"]["packets"])
    return counts
