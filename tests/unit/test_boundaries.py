"""The packages' boundaries, read from the source with ast (docs/packages.md has the rule).

A module's private name (`_x`, a module or anything else) is private to the package that holds
it: it may be imported by that package's own modules and by the modules of its subpackages, and
by nothing else. feos/_schema.py is private to `feos`, and every module of feos/ is inside
`feos`, so all of them may import it; feos/vmm/_driver.py is private to feos.vmm, which
feos.pods is not inside: feos.pods takes its names from feos.vmm's face. Every import counts,
at the top or in a function, under TYPE_CHECKING or not. Tests, benchmarks and integration
tests are not the package and may import anything.

Also here: the packages under feos import each other without a cycle (pods takes the network's
contract from feos.net, and net imports nothing of pods); every import of feos names a module
that exists; the node's side imports nothing of the guest agent's own Cap'n Proto; the agent
imports nothing of the node; and the guest image ships none of the node's guest link.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from _modpath import load

REPO = Path(__file__).resolve().parents[2]
FEOS = REPO / "feos"

# Known offenders: none. Each entry would be (importing module, module imported).
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(path: Path) -> str:
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module imported, names taken from it) for every import in the file, resolved."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = package_of(path).split(".")
                anchor = ".".join(package[: len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            yield node.lineno, base, [alias.name for alias in node.names]


def owner_of_private(target: str) -> str | None:
    """The package whose private name `target` reaches (feos.vmm for feos.vmm._driver.X)."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def sources() -> list[Path]:
    return sorted(p for p in FEOS.rglob("*.py") if "__pycache__" not in p.parts)


def feos_imports() -> Iterator[tuple[Path, int, str, str]]:
    """(file, line, importing module, name imported) for each name of feos a module imports."""
    for path in sources():
        me = module_name(path)
        for line, module, names in imports(path):
            if module == "feos" or module.startswith("feos."):
                for target in [f"{module}.{n}" for n in names] or [module]:
                    yield path, line, me, target


def exists(module: str) -> bool:
    base = REPO.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_part(path: Path, module: str) -> str:
    """The module an import's target lies in (feos.vmm for the name feos.vmm.MicroVms)."""
    while module and not exists(module):
        module = module.rpartition(".")[0]
    return module


def test_no_module_imports_another_packages_private_name() -> None:
    found = []
    for path, line, me, target in feos_imports():
        owner = owner_of_private(target)
        if owner is None or me == owner or me.startswith(owner + "."):
            continue
        allowed = any(me == a and (target + ".").startswith(b + ".") for a, b in ALLOWED)
        if not allowed:
            found.append(f"{path.relative_to(REPO)}:{line}: {me} imports {target}")
    assert found == []


def test_the_allow_list_lists_only_what_is_still_there() -> None:
    seen = {(me, b) for _, _, me, target in feos_imports() for a, b in ALLOWED
            if me == a and (target + ".").startswith(b + ".")}  # fmt: skip
    assert seen == ALLOWED


def test_every_import_of_feos_names_a_module_that_exists() -> None:
    missing = []
    for path, line, me, target in feos_imports():
        module = target if exists(target) else target.rpartition(".")[0]
        if any(me == a and (target + ".").startswith(b + ".") for a, b in ALLOWED):
            continue
        if not exists(module):
            missing.append(f"{path.relative_to(REPO)}:{line}: {me} imports {target}")
    assert missing == []


def subpackage(module: str) -> str | None:
    """feos.net for feos.net._service; None for feos itself and its top-level modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (FEOS / parts[1]).is_dir() else None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path, _, me, target in feos_imports():
        src, dst = subpackage(me), subpackage(module_part(path, target))
        if src is not None and dst is not None and src != dst:
            graph.setdefault(src, set()).add(dst)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph, or []."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_net_imports_nothing_of_pods_and_the_packages_have_no_cycle() -> None:
    graph = package_graph()
    assert "feos.pods" not in graph.get("feos.net", set())
    assert "feos.net" in graph["feos.pods"]
    assert cycle(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}}) == []


def test_the_agent_imports_nothing_of_the_node() -> None:
    """feos/guest/ (the image's) imports of feos: feos, feos.errors and its own modules only."""
    found = []
    for path, line, me, target in feos_imports():
        if me.startswith("feos.guest.") or me == "feos.guest":
            module = module_part(path, target)
            if module not in ("feos", "feos.errors") and not module.startswith("feos.guest"):
                found.append(f"{path.relative_to(REPO)}:{line}: {me} imports {target}")
    assert found == []


def test_the_image_ships_none_of_the_nodes_guest_link() -> None:
    build = load("feos_guest_build_boundaries", REPO / "packaging/guest/build.py")
    shipped = [dst for dst, _ in build.agent_sources(REPO)]
    assert "feos/guest/_hello.py" in shipped and "feos/guest/_link.py" in shipped
    assert not [dst for dst in shipped if dst.startswith("feos/guestlink/")]
    assert "feos/guest/_client.py" not in shipped and "feos/guest/_schema.py" not in shipped


def test_the_node_loads_none_of_the_guests_own_capnp() -> None:
    program = """
import sys
import feos.guestlink, feos.vmm, feos.daemon
print(" ".join(sorted(m for m in sys.modules if m.startswith("feos.guest."))))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True)  # fmt: skip
    assert out.stdout.split() == ["feos.guest._hello", "feos.guest._link"]
