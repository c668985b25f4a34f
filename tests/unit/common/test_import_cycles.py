"""The project's own modules import each other without cycles (issues 12 and 15).

Every import counts: module-level, inside a function, and under ``TYPE_CHECKING``
(a cycle that only the type checker sees is still two modules that cannot be read
or tested apart). The graph is read from the sources with :mod:`ast`, so nothing is
imported. A cycle listed in ``KNOWN`` is tolerated, with its reason; any other fails
the test, and so does a known one that is gone (take it off the list).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("bus_schemas", "services", "perigee", "tracing")

KNOWN: dict[frozenset[str], str] = {}


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` stands for: itself, else its closest package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                # ``from pkg import mod`` imports pkg.mod; ``from mod import name``, mod
                names = [f"{source}.{a.name}" for a in node.names]
            for name in names:
                target = _target(name, mods)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_cycle_finder_finds_exactly_the_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert sorted(map(sorted, cycles(g))) == [["a", "b", "c"], ["e", "f"]]


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph(project_modules())
    assert "services.store.block_pool" in graph["services.store.server"]  # from x import y
    assert "services.store.tiers.lower" in graph["services.store.block_pool"]
    assert "services.engine.vllm.options" in graph["services.engine"]  # under TYPE_CHECKING
    assert "services.common.admission_mode" in graph["perigee.sim.repro"]  # inside a function


def test_no_import_cycles_but_the_known_ones():
    found = set(cycles(import_graph(project_modules())))
    new = [sorted(c) for c in found - set(KNOWN)]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in set(KNOWN) - found]
    assert not gone, f"these known cycles are gone, take them off KNOWN: {gone}"


# Each layer imports only from the layers below it (issue 15: services/common is the
# ground floor). A service package may import common, bus_schemas and tracing, and the
# services named here besides.
LAYERS: dict[str, tuple[str, ...]] = {
    "bus_schemas": ("bus_schemas",),
    "tracing": ("tracing",),
    "services.common": ("services.common", "bus_schemas", "tracing"),
}


def test_the_ground_floor_imports_nothing_above_it():
    graph = import_graph(project_modules())
    bad = []
    for mod, deps in sorted(graph.items()):
        for layer, allowed in LAYERS.items():
            if mod == layer or mod.startswith(layer + "."):
                bad += [
                    (mod, d)
                    for d in sorted(deps)
                    if not any(d == a or d.startswith(a + ".") for a in allowed)
                ]
    assert not bad, f"imports from above the module's layer: {bad}"
