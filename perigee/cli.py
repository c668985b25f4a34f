"""``perigee <command>``: each command lives in its own module and is imported on use,
so ``perigee up`` does not pay for the simulator's imports and vice versa."""

import argparse
import ast
import importlib
import importlib.util
import sys
import textwrap

COMMANDS = {
    "up": ("perigee.up", "start nats-server and every service"),
    "multihost": ("perigee.multihost", "the stack over N hosts in network namespaces (root)"),
    "model": ("perigee.models", "prepare the default model (or convert a .gguf) once"),
    "bench": (
        "perigee.bench",
        "benchmarks: pipeline, reuse, transfer, ship, store, conductor, calibration, slo, migration, chaos, agreement, multiturn, capacity, capacity-ab",
    ),
    "replay": ("perigee.replay", "replay a Mooncake trace against an OpenAI endpoint"),
    "breakdown": ("perigee.breakdown", "per-request latency breakdown from a spans file (Fig. 22)"),
    "sim": ("perigee.sim.cli", "discrete-event simulator: replay a trace through the policies"),
    "profile": ("perigee.profile", "measure prefill/decode times and fit the cost model"),
    "render": (
        "perigee.render",
        "write compose.yaml's and deploy/k8s's command lines from perigee.deploy_spec",
    ),
}


def bench_help() -> str:
    """``perigee bench --help``: each bench with the first paragraph of its module's
    docstring, read without importing the bench (some import vLLM)."""
    from perigee.bench import BENCHES

    lines = [
        "usage: perigee bench NAME [options]   (perigee bench NAME --help: its options)",
        "",
        "Benchmarks, each measured beside its baseline in one run (figures: BENCHMARKS.md):",
        "",
    ]
    for name, module in BENCHES.items():
        spec = importlib.util.find_spec(module)
        doc = ""
        if spec is not None and spec.origin:
            with open(spec.origin) as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        what = first.split("``: ", 1)[-1] if first.startswith("``") else first
        lines.append(
            textwrap.fill(what, 88, initial_indent=f"  {name:<13}", subsequent_indent=" " * 15)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(bench_help(), file=sys.stdout if len(argv) > 1 else sys.stderr)
        return 0 if len(argv) > 1 else 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(prog="perigee")
        sub = p.add_subparsers(dest="command", required=True)
        for name, (_, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_)
        p.parse_args(argv)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
