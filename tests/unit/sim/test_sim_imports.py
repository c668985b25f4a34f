"""The simulator runs the pure policies, never a service adapter (issue 26 item 1): no
module of perigee/sim imports a service's NATS shell (``services.<x>.service``, its
``__main__``) or the stack launcher (``perigee.stack``, ``perigee.up``); the defaults
they share come from services.common.defaults."""

import ast
import subprocess
import sys
from pathlib import Path

SIM = Path(__file__).resolve().parents[3] / "perigee" / "sim"
FORBIDDEN = ("perigee.stack", "perigee.up")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _adapter(name: str) -> bool:
    parts = name.split(".")
    return name in FORBIDDEN or (
        parts[0] == "services" and len(parts) >= 3 and parts[2] in ("service", "__main__")
    )


def test_no_simulator_module_imports_a_service_adapter_or_the_stack():
    bad = {
        f"{p.name}: {name}"
        for p in sorted(SIM.glob("*.py"))
        for name in _imports(p)
        if _adapter(name)
    }
    assert not bad, sorted(bad)


def test_a_simulation_loads_no_adapter():
    code = (
        "import sys\n"
        "from perigee.sim.simulator import simulate_slice\n"
        "from perigee.trace import TraceRequest\n"
        "simulate_slice([TraceRequest(0.0, 600, 4, (1,)), TraceRequest(0.1, 700, 4, (1,))],"
        " block_size=512)\n"
        "bad = [m for m in sys.modules if m in ('perigee.stack', 'perigee.up')"
        " or (m.startswith('services.') and m.split('.')[-1] in ('service', '__main__'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
