"""Write a seeded random checkpoint for a LLaMA config (tests, benchmarks, demos).

    .venv/bin/python scripts/make_random_weights.py OUT_DIR [--model models/tiny-llama] [--seed 0]

Copies the model directory's config and tokenizer files to OUT_DIR and adds a
``model.safetensors`` drawn from numpy's PCG64 with ``--seed`` (byte-identical on any
machine; 12 MB for tiny-llama). vLLM's ``load_format="dummy"`` weights (what
``perigee up`` serves for models/tiny-llama, which has no weights) give the same
couple of tokens whatever the prompt; these give prompt-dependent greedy output, so
``perigee up --model OUT_DIR`` shows real reuse and exact disaggregated decoding.
Needs safetensors (installed with vLLM).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.model_spec import DEFAULT_MODEL_DIR  # noqa: E402
from services.engine.vllm.weights import write_random_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="config + tokenizer source")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = write_random_checkpoint(a.model, a.out, seed=a.seed)
    print(f"wrote {out / 'model.safetensors'} (seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
