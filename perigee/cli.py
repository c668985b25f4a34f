"""``perigee <command>``: each command lives in its own module and is imported on use,
so ``perigee up`` does not pay for the simulator's imports and vice versa."""

import argparse
import importlib
import sys

COMMANDS = {
    "up": ("perigee.up", "start nats-server and every service"),
    "multihost": ("perigee.multihost", "the stack over N hosts in network namespaces (root)"),
    "model": ("perigee.models", "prepare the default model (or convert a .gguf) once"),
    "bench": (
        "perigee.bench",
        "benchmarks: pipeline, reuse, transfer, ship, store, conductor, calibration, slo, migration, chaos, agreement",
    ),
    "replay": ("perigee.replay", "replay a Mooncake trace against an OpenAI endpoint"),
    "breakdown": ("perigee.breakdown", "per-request latency breakdown from a spans file (Fig. 22)"),
    "sim": ("perigee.sim.cli", "discrete-event simulator: replay a trace through the policies"),
    "profile": ("perigee.profile", "measure prefill/decode times and fit the cost model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
