"""camelCase (Cap'n Proto's field and enum names) to snake_case (Python's) and back.

Apart from feos._codec so that feosctl's start, which needs only these, does not import cattrs.
"""

from __future__ import annotations

import re

_CAMEL = re.compile(r"_([a-z0-9])")
_SNAKE = re.compile(r"(?<!^)([A-Z])")


def camel(name: str) -> str:
    return _CAMEL.sub(lambda m: m.group(1).upper(), name)


def snake(name: str) -> str:
    return _SNAKE.sub(lambda m: "_" + m.group(1).lower(), name)
