"""TemplateService (schema/template.capnp): the node's pod templates, listed, warmed, removed."""

from __future__ import annotations

from typing import Any

import attrs

from .._codec import NoParams, takes
from ..errors import Code, FeosError, invalid
from ._templates import Shape, Templates, check_held


def _name(value: str) -> str:
    if not value:
        raise invalid("templateName", "must name a template")
    return value


@attrs.frozen
class WarmTemplate:
    vcpus: int = 0
    memory_mib: int = 0
    disk_size_mib: int = 0
    network: bool = False
    image: str = ""

    def shape(self) -> Shape:
        if self.disk_size_mib and not 1024 <= self.disk_size_mib <= 16 << 20:
            raise invalid("diskSizeMib", "must be 0 (the guest's default) or 1024 to 16 TiB")
        if self.memory_mib and self.memory_mib < 128:
            raise invalid("memoryMib", "must be 0 (512) or 128 or more")
        return Shape(self.vcpus or 1, self.memory_mib or 512, self.disk_size_mib, self.network)


@attrs.frozen
class TemplateRef:
    template_name: str = attrs.field(default="", converter=_name)


class TemplateApi:
    def __init__(self, templates: Templates | None) -> None:
        self._templates = templates

    def _need(self) -> Templates:
        if self._templates is None:
            raise FeosError(Code.FAILED_PRECONDITION, "this node makes no templates (no diskd)")
        return self._templates

    @takes(NoParams)
    async def list_templates(self, call: NoParams) -> dict[str, Any]:
        return {"templates": self._need().list() if self._templates is not None else []}

    @takes(WarmTemplate)
    async def warm_template(self, call: WarmTemplate) -> dict[str, Any]:
        templates = self._need()
        shape = call.shape()
        if call.image:
            check_held(call.image, shape, "image")
        template = await templates.warm(shape, await templates.blank(), call.image)
        return {"template": template.answer(templates.root / template.name)}

    @takes(TemplateRef)
    async def remove_template(self, call: TemplateRef) -> dict[str, Any]:
        await self._need().remove(call.template_name)
        return {}
