"""The import layers of DESIGN.md, checked on the source (issue 26 item 4).

    0  bus_schemas, tracing          the wire types and trace propagation
    1  services/common               what several services share
    2  pure policies                 decisions with no I/O, shared with the simulator:
                                     services/policy and the modules in PURE_POLICIES
    3  services                      the adapters: bus, sockets, engines, processes
                                     (services/transfer, the transfer engine, among them)
    4  perigee                       the CLI, the stack, benches and the simulator

A module imports only from its own layer or those below (bus_schemas and tracing not
from each other). On top of that:

- a pure policy, with everything it loads (the package ``__init__``s Python runs on the
  way included), reaches no service adapter and no I/O library;
- the simulator (``perigee/sim``) runs the policies, not the services: it reaches no
  service adapter and, of the CLI, only the trace reader and the bench statistics;
- within layer 3 (issue 26 item 3): the transfer engine (``services/transfer``) imports
  no other service; the store's metadata (``services/store/pool``) imports nothing of
  the store's node, clients or transfer engine, and its clients nothing of its node;
  ``services/worker`` imports neither worker (each role's package builds its own), and
  the prefill and decode packages import each other only in their entry points
  (``__main__``: a switchable process serves both roles).

The graph is tests/unit/import_graph.py's (read with ``ast``, nothing imported): an
import inside a function or under ``TYPE_CHECKING`` counts as much as one at the top. An import that breaks a rule today
and is being removed goes in ALLOWED with the issue item that removes it; an allowance
that no longer matches an import fails too, so the list only shrinks. ``make lint``
runs this file.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tests.unit.import_graph import import_graph, libraries, project_modules

# Layer 2: the pure decisions (DESIGN: "policy is pure, services are thin, the simulator
# runs the same policy code"): services/policy (what several services share) and, in
# the services' own packages, what perigee/sim loads of services/ and the store's
# replica ranking. Pure, but not here: the gateway's own helpers
# (services.gateway.resend, .watchdog: importing them runs services/gateway/__init__,
# which loads the server) and the data plane's pieces (the store's fence, the transfer
# backends' slicing).
# A module listed here that no longer exists fails the test: move its line with it.
PURE_POLICIES = frozenset(
    {
        "services.admission.admission_policy",
        "services.admission.time_index",
        "services.conductor.balancing",
        "services.conductor.feedback",
        "services.conductor.load_order",
        "services.conductor.migrated_placement",
        "services.conductor.pd_ratio",
        "services.conductor.placement_round",
        "services.conductor.placement_policy",
        "services.conductor.prefix_index",
        "services.conductor.search",
        "services.prefill.queue",
        "services.store.pool.block_pool",
        "services.store.pool.eviction",
        "services.store.pool.lower_tiers",
        "services.store.pool.replicas",
        "services.store.pool.tier_policy",
    }
)

# What a pure policy may not reach, even through services/common: the bus, sockets,
# processes, threads of its own, engines, metrics and logs (a policy returns a
# decision; its adapter does the I/O).
IO_LIBRARIES = frozenset(
    {
        "aiohttp",
        "asyncio",
        "multiprocessing",
        "nats",
        "opentelemetry",
        "prometheus_client",
        "pyverbs",
        "socket",
        "structlog",
        "subprocess",
        "threading",
        "torch",
        "uvloop",
        "vllm",
        "zmq",
    }
)

# The CLI modules the simulator may use.
SIM_MAY_USE = frozenset({"perigee", "perigee.trace", "perigee.bench", "perigee.bench.stats"})

# (importer, imported module or I/O library) -> the issue item that removes it. Empty
# when this check was written (issue 26): no module imports upward, no pure policy
# reaches an adapter or I/O, the simulator reaches no service adapter and no
# perigee.stack. Add a line only with the item that takes it out again.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported}"


MODULES = project_modules()
EDGES = {
    m: [Edge(m, dep, line) for dep, line in deps.items()]
    for m, deps in import_graph(MODULES).items()
}


def _libraries(name: str) -> dict[str, int]:
    return libraries(name, MODULES[name])


def is_pure(name: str) -> bool:
    return name in PURE_POLICIES or name.split(".")[:2] == ["services", "policy"]


def layer(name: str) -> int:
    top = name.split(".")[0]
    if top in ("bus_schemas", "tracing"):
        return 0
    if name == "services" or name.startswith("services.common"):
        return 1
    if is_pure(name):
        return 2
    if top == "services":
        return 3
    assert top == "perigee", name
    return 4


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _loads(name: str) -> dict[str, list[str]]:
    """Every project module that importing ``name`` runs, each with the shortest chain
    that reaches it: the imports, and the package ``__init__`` of each module on the way."""
    chains = {name: [name]}
    todo = deque([name])
    while todo:
        m = todo.popleft()
        parents = [m.rsplit(".", i)[0] for i in range(m.count("."), 0, -1)]
        for nxt in parents + [e.imported for e in EDGES[m]]:
            if nxt not in chains:
                chains[nxt] = chains[m] + [nxt]
                todo.append(nxt)
    return chains


def _allowed(importer: str, imported: str) -> bool:
    return (importer, imported) in ALLOWED


def _upward(e: Edge) -> bool:
    if layer(e.imported) > layer(e.importer):
        return True
    # bus_schemas and tracing share the ground floor but not each other (issue 15).
    tops = {e.importer.split(".")[0], e.imported.split(".")[0]}
    return layer(e.importer) == 0 and len(tops) == 2


def upward_imports() -> list[str]:
    return [
        f"{e.where()} (layer {layer(e.importer)} -> {layer(e.imported)})"
        for edges in EDGES.values()
        for e in edges
        if _upward(e) and not _allowed(e.importer, e.imported)
    ]


def _crossings(roots: list[str], forbidden: Callable[[str], str]) -> list[str]:
    """Where what ``roots`` load first steps out of bounds: each module ``forbidden``
    names (its reason) or that imports an I/O library, reported once, at the first such
    step of its chain, with an example chain (what it loads in turn is not repeated)."""
    bad: dict[str, str] = {}
    for root in roots:
        for m, chain in _loads(root).items():
            if any(forbidden(x) for x in chain[:-1]):
                continue  # reported where the chain first stepped out
            why = forbidden(m)
            if why and not _allowed(chain[-2], m):
                bad.setdefault(f"{chain[-2]} imports {why} {m}", " -> ".join(chain))
            elif not why and root in PURE_POLICIES:
                for lib, line in _libraries(m).items():
                    if lib in IO_LIBRARIES and not _allowed(m, lib):
                        bad.setdefault(f"{m}:{line} imports {lib}", " -> ".join(chain))
    return [f"{k}  (via {v})" for k, v in sorted(bad.items())]


def _adapter(name: str) -> str:
    return "the service adapter" if layer(name) == 3 and not _is_package(name) else ""


def impure_policies() -> list[str]:
    return _crossings(sorted(m for m in MODULES if is_pure(m)), _adapter)


def simulator_reaches() -> list[str]:
    def forbidden(m: str) -> str:
        if layer(m) == 4 and not m.startswith("perigee.sim") and m not in SIM_MAY_USE:
            return "the CLI module"
        return _adapter(m)

    return _crossings(sorted(m for m in MODULES if m.startswith("perigee.sim")), forbidden)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# (importer's package, imported package): an import that would tangle a service's parts
# (issue 26 item 3). Entry points (``__main__``) are exempt: they put a process together.
TANGLES = (
    *(
        ("services.transfer", s)
        for s in ("services.store", "services.prefill", "services.decode", "services.worker")
    ),
    *(
        ("services.store.pool", s)
        for s in ("services.store.node", "services.store.client", "services.transfer")
    ),
    ("services.store.client", "services.store.node"),
    ("services.worker", "services.prefill"),
    ("services.worker", "services.decode"),
    ("services.prefill", "services.decode"),
    ("services.decode", "services.prefill"),
)


def tangles() -> list[str]:
    return [
        f"{e.where()} ({a} must not import {b})"
        for edges in EDGES.values()
        for e in edges
        for a, b in TANGLES
        if _within(e.importer, a)
        and _within(e.imported, b)
        and not e.importer.endswith(".__main__")
        and not _allowed(e.importer, e.imported)
    ]


def test_the_transfer_engine_store_parts_and_workers_import_no_further() -> None:
    bad = tangles()
    assert not bad, "\n".join(["a service's parts tangle:", *bad])


def test_a_tangle_is_caught(monkeypatch) -> None:
    edge = Edge("services.worker.settings", "services.prefill.worker", 3)
    monkeypatch.setitem(EDGES, edge.importer, [*EDGES[edge.importer], edge])
    assert tangles() == [f"{edge.where()} (services.worker must not import services.prefill)"]


def test_nothing_imports_upward() -> None:
    bad = upward_imports()
    assert not bad, "\n".join(["imports upward:", *bad])


def test_pure_policies_reach_no_adapter_and_no_io() -> None:
    bad = impure_policies()
    assert not bad, "\n".join(["a pure policy loads I/O:", *bad])


def test_the_simulator_reaches_no_service_adapter_and_no_stack() -> None:
    bad = simulator_reaches()
    assert not bad, "\n".join(["the simulator loads more than the policies:", *bad])


def test_every_listed_pure_policy_and_allowance_exists() -> None:
    assert sorted(PURE_POLICIES - MODULES.keys()) == [], "a pure policy moved: move its line"
    imports = {(e.importer, e.imported) for edges in EDGES.values() for e in edges}
    imports |= {(m, lib) for m in MODULES for lib in _libraries(m)}
    stale = [pair for pair in ALLOWED if pair not in imports]
    assert stale == [], "an allowance no import needs any more: remove it"


def test_each_module_is_in_the_layer_its_role_says() -> None:
    assert [layer(m) for m in ("bus_schemas.requests", "tracing.setup")] == [0, 0]
    assert [layer(m) for m in ("services", "services.common.clock")] == [1, 1]
    assert layer("services.conductor.placement_policy") == layer("services.prefill.queue") == 2
    assert layer("services.policy") == layer("services.policy.chunk_timing") == 2
    assert layer("services.transfer.batch_api") == layer("services.store.pool.registry") == 3
    assert layer("services.conductor.service") == layer("services.store.node.server") == 3
    assert layer("perigee.stack") == layer("perigee.sim.simulator") == 4


def test_an_upward_import_is_caught_and_an_allowance_silences_it(monkeypatch) -> None:
    # services.common.clock (layer 1), which every policy and the simulator load,
    # imports the conductor's NATS adapter.
    edge = Edge("services.common.clock", "services.conductor.service", 7)
    monkeypatch.setitem(EDGES, edge.importer, [*EDGES[edge.importer], edge])
    assert upward_imports() == [f"{edge.where()} (layer 1 -> 3)"]
    assert any(
        "clock imports the service adapter services.conductor.service" in b
        for b in impure_policies()
    )
    assert any("services.conductor.service" in b for b in simulator_reaches())
    monkeypatch.setitem(ALLOWED, (edge.importer, edge.imported), "issue 26 item 1 (test)")
    assert upward_imports() == impure_policies() == simulator_reaches() == []
