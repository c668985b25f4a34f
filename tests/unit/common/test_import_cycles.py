"""The project's own modules import each other without cycles (issues 12 and 15).

Every import counts: module-level, inside a function, and under ``TYPE_CHECKING``
(a cycle that only the type checker sees is still two modules that cannot be read
or tested apart). The graph is tests/unit/import_graph.py's, read from the sources
with :mod:`ast`, so nothing is imported; which way imports may go is checked by
tests/unit/test_import_layers.py. A cycle listed in ``KNOWN`` is tolerated, with its
reason; any other fails the test, and so does a known one that is gone (take it off
the list).
"""

from collections.abc import Iterable, Mapping

from tests.unit.import_graph import import_graph, project_modules

KNOWN: dict[frozenset[str], str] = {}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
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
    # from x import y
    assert "services.store.pool.block_pool" in graph["services.store.node.server"]
    assert "services.store.pool.lower_tiers" in graph["services.store.pool.block_pool"]
    assert "services.engine.vllm.options" in graph["services.engine"]  # under TYPE_CHECKING
    assert "services.common.admission_mode" in graph["perigee.sim.repro"]  # inside a function


def test_no_import_cycles_but_the_known_ones():
    found = set(cycles(import_graph(project_modules())))
    new = [sorted(c) for c in found - set(KNOWN)]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in set(KNOWN) - found]
    assert not gone, f"these known cycles are gone, take them off KNOWN: {gone}"
