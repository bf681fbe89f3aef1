"""Suspend on stop: the running pods suspended for the next feosd, which resumes them.

On SIGTERM with --suspend-on-stop, every running pod is suspended, four at a time; each one is
added to <state-dir>/suspended-for-stop.json (written whole and synced) as soon as it is
suspended, so a stop that is killed keeps what it did. A pod whose microVM is busy is tried again
every 5 s after the first pass, until it goes, or the stop's time runs out. The next feosd resumes
the recorded pods that are still suspended, four at a time, writing the record as each one goes,
and removes it; a pod whose resume fails stays suspended and is logged. With a control plane a
stop longer ago than five minutes is not resumed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..errors import FeosError
from ..records import remove_whole, write_whole

if TYPE_CHECKING:
    from ._service import PodService

log = logging.getLogger(__name__)

AT_ONCE = 4
BUSY_RETRY_S = 5.0
STALE_S = 300.0


class SuspendedForStop:
    def __init__(self, path: Path, *, control_plane: bool = False) -> None:
        self.path = path
        self._control_plane = control_plane
        self._lock = trio.Lock()

    def read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("%s is unreadable (%s): no pod is resumed from it", self.path, exc)
            return None
        return data if isinstance(data, dict) else None

    async def _write(self, stopped_ns: int, pods: list[str]) -> None:
        data = json.dumps({"stoppedUnixNs": stopped_ns, "pods": sorted(pods)}).encode()
        async with self._lock:
            await trio.to_thread.run_sync(write_whole, self.path, data)

    async def suspend_all(self, pods: PodService) -> None:
        pods.refuse_changes()
        stopped_ns = time.time_ns()
        done: list[str] = []
        busy: list[str] = []
        limiter = trio.CapacityLimiter(AT_ONCE)

        async def one(pod_id: str) -> None:
            async with limiter:
                try:
                    await pods.suspend_for_stop(pod_id)
                except FeosError as exc:
                    if exc.busy:
                        busy.append(pod_id)
                        return
                    log.error("pod %s could not be suspended for the stop: %s", pod_id, exc)
                    return
            done.append(pod_id)
            await self._write(stopped_ns, done)

        running = pods.running()
        log.info("suspending %d running pod(s) for the next feosd", len(running))
        async with trio.open_nursery() as nursery:
            for pod_id in running:
                nursery.start_soon(one, pod_id)
        while busy:
            await trio.sleep(BUSY_RETRY_S)
            again, busy[:] = list(busy), []
            for pod_id in again:
                if pods.is_suspended(pod_id):
                    done.append(pod_id)
                    await self._write(stopped_ns, done)
                else:
                    await one(pod_id)

    async def resume(self, pods: PodService) -> None:
        record = self.read()
        if record is None:
            return
        stopped_ns = int(record.get("stoppedUnixNs", 0))
        left = [p for p in record.get("pods", []) if isinstance(p, str)]
        if self._control_plane and time.time_ns() - stopped_ns > STALE_S * 1e9:
            log.warning("the stop that suspended %s was over five minutes ago: the pods stay "
                        "suspended for the control plane", ", ".join(left))
            await trio.to_thread.run_sync(remove_whole, self.path)
            return
        limiter = trio.CapacityLimiter(AT_ONCE)

        async def one(pod_id: str) -> None:
            async with limiter:
                if pods.is_suspended(pod_id):
                    try:
                        await pods.resume_after_stop(pod_id)
                        log.info("pod %s resumed after the stop", pod_id)
                    except FeosError as exc:
                        log.error("pod %s stays suspended: its resume failed: %s", pod_id, exc)
                left.remove(pod_id)
                await self._write(stopped_ns, left)

        async with trio.open_nursery() as nursery:
            for pod_id in list(left):
                nursery.start_soon(one, pod_id)
        await trio.to_thread.run_sync(remove_whole, self.path)
