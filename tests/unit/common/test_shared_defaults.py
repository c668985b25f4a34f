"""The SLOs and --dead-after have one home, services/common/defaults.py: no service,
config dataclass or tool writes their numbers again (issue 26: "--dead-after 2.0
three times")."""

import ast
import importlib
from pathlib import Path

import pytest

from perigee.stack import StackConfig
from services.admission.service import AdmissionConfig
from services.common import defaults
from services.conductor.service import ConductorConfig
from services.gateway.server import GatewayConfig

ROOT = Path(__file__).resolve().parents[3]
NAMES = {"dead_after_s", "dead_after", "ttft_slo_s", "tbt_slo_s", "ttft_slo", "tbt_slo"}
FLAGS = {"--dead-after", "--ttft-slo", "--tbt-slo"}


def _number(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def _literal_defaults(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each number written as the default of a field, parameter or
    flag named in NAMES / FLAGS."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in NAMES and _number(node.value):
                out.append((node.lineno, node.target.id))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d]
            out += [(node.lineno, k.arg) for k, d in pairs if k.arg in NAMES and _number(d)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flag = node.args[0] if node.args else None
            if isinstance(flag, ast.Constant) and flag.value in FLAGS:
                out += [
                    (node.lineno, flag.value)
                    for kw in node.keywords
                    if kw.arg == "default" and _number(kw.value)
                ]
    return out


def test_no_module_writes_the_shared_numbers_again():
    found = []
    for top in ("services", "perigee"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, name in _literal_defaults(ast.parse(path.read_text())):
                found.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert found == [], "read these from services/common/defaults.py: " + ", ".join(found)


def test_the_guard_sees_a_literal():
    src = (
        "class C:\n    dead_after_s: float = 2.0\n"
        "def f(x, tbt_slo_s=0.1): pass\n"
        "p.add_argument('--ttft-slo', type=float, default=30.0)\n"
        "p.add_argument('--dead-after', default=defaults.DEAD_AFTER_S)\n"
    )
    assert sorted(_literal_defaults(ast.parse(src))) == [
        (2, "dead_after_s"),
        (3, "tbt_slo_s"),
        (4, "--ttft-slo"),
    ]


def test_the_services_declare_the_shared_flags_in_one_place():
    """--ttft-slo, --tbt-slo and --dead-after: services.common.shared_flags declares
    them for every service (the tools in perigee/ keep their own: other defaults)."""
    where = set()
    for path in sorted((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flag = node.args[0] if node.args else None
                if isinstance(flag, ast.Constant) and flag.value in FLAGS:
                    where.add(str(path.relative_to(ROOT)))
    assert where == {"services/common/shared_flags.py"}


@pytest.mark.parametrize("service", ["gateway", "admission", "conductor"])
def test_each_service_defaults_to_the_shared_values(service):
    args = importlib.import_module(f"services.{service}.__main__").parse_args([])
    assert args.dead_after == defaults.DEAD_AFTER_S
    assert (args.ttft_slo, args.tbt_slo) == (defaults.TTFT_SLO_S, defaults.TBT_SLO_S)


def test_a_worker_takes_the_tbt_slo_only():
    from services.decode.__main__ import parse_args

    args = parse_args([])
    assert args.tbt_slo == defaults.TBT_SLO_S and not hasattr(args, "ttft_slo")


def test_the_configs_default_to_the_shared_values():
    for cfg in (GatewayConfig(), AdmissionConfig(), ConductorConfig()):
        assert cfg.dead_after_s == defaults.DEAD_AFTER_S, type(cfg).__name__
        assert (cfg.ttft_slo_s, cfg.tbt_slo_s) == (defaults.TTFT_SLO_S, defaults.TBT_SLO_S)
    stack = StackConfig()
    assert (stack.dead_after, stack.ttft_slo, stack.tbt_slo) == (
        defaults.DEAD_AFTER_S,
        defaults.TTFT_SLO_S,
        defaults.TBT_SLO_S,
    )
