"""PodService.consoleLog: a pod's serial console (its microVM's serial.log) as a ByteStream.

Kept out of the service's module: `console_log(pods, vms, params)` is what PodService's
`console_log` method calls. The pod must exist (NOT_FOUND otherwise); a pod whose microVM was
never made (pending before its VM, or failed early) has no console yet: FAILED_PRECONDITION.
A followed log ends once the microVM no longer runs.
"""

from __future__ import annotations

from typing import Any

from .. import _schema
from ..errors import Code, FeosError
from ..rpc import Cap
from ..vmm import SerialLog, VmState, serial_log_path


async def console_log(pods: Any, vms: Any, params: dict[str, Any]) -> dict[str, Any]:
    pod = (await pods.get_pod({"id": params.get("id", "")}))["pod"]
    try:
        info = vms.get(pod["id"])
    except FeosError:
        raise FeosError(Code.FAILED_PRECONDITION,
                        f"pod {pod['id']} has no microVM yet: no console to read") from None
    path = serial_log_path(pods.state_dir, info.driver, info.id)

    def alive() -> bool:
        try:
            return bool(vms.get(info.id).state is VmState.RUNNING)
        except FeosError:
            return False

    stream = SerialLog(path, bool(params.get("follow", False)), alive)
    return {"stream": Cap(_schema.pod().ByteStream, stream)}
