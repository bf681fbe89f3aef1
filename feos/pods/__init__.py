"""feos.pods: the pod service and the volume service over feos.vmm and feos.net (docs/pods.md).

The names load on first use (PEP 562): feosctl takes new_pod_id alone, and the pod service
would bring trio, the microVMs and the network into its start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._console import console_log as console_log
    from ._service import PodService as PodService
    from ._spec import new_pod_id as new_pod_id
    from ._stop import SuspendedForStop as SuspendedForStop
    from ._template_api import TemplateApi as TemplateApi
    from ._templates import TemplateShape as TemplateShape
    from ._templates import TemplateWarm as TemplateWarm
    from ._volumes import VolumeService as VolumeService

_LAZY = {
    "PodService": "_service", "new_pod_id": "_spec", "SuspendedForStop": "_stop",
    "VolumeService": "_volumes", "console_log": "_console", "TemplateApi": "_template_api",
    "TemplateShape": "_templates",
    "TemplateWarm": "_templates",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)
