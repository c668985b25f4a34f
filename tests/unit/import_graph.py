"""The project's import graph, read from the sources with :mod:`ast` (nothing is
imported), for the checks on it: no cycles (common/test_import_cycles.py) and the
layers (test_import_layers.py).

Every import counts: module-level, inside a function, and under ``TYPE_CHECKING``.
``from pkg import mod`` is an import of ``pkg.mod``; ``from mod import name`` of
``mod``; ``import a.b`` of ``a.b``. A package's ``__init__`` also runs when one of
its modules is imported: that edge is implicit (see ``loads`` in the layers test).
"""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bus_schemas", "services", "perigee", "tracing")


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def target(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` stands for: itself, else its closest package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def imported_names(mod: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every absolute name the source of ``mod`` imports, with its line."""
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports pkg.mod; ``from mod import name``, mod
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def import_graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Each project module -> the project modules it imports, each at its first line."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        deps: dict[str, int] = {}
        for name, line in imported_names(mod, path):
            dep = target(name, mods)
            if dep is not None and dep != mod:
                deps.setdefault(dep, line)
        graph[mod] = deps
    return graph


def libraries(mod: str, path: Path) -> dict[str, int]:
    """The top-level names ``mod`` imports from outside the project, each at a line."""
    out: dict[str, int] = {}
    for name, line in imported_names(mod, path):
        top = name.split(".")[0]
        if top and top not in PACKAGES:
            out.setdefault(top, line)
    return out
