"""Plain vLLM serving conversations (tests' reference, benches' baseline for multi-turn
reuse): ``python -m services.engine.vllm.conversation SPEC.json OUT.json``.

SPEC is :mod:`.reference`'s engine part (``model_dir``, ``prefix_caching``, ``block_size``,
``max_model_len``, ...) with ``"conversations": [[{"prompt": [ids], "max_tokens": n}, ...]]``:
each turn's prompt is the previous turn's prompt, its output, then the turn's ``prompt``
(the first turn's is its own), as a chat client sends it. Turns run one after another,
greedy (temperature 0, ignore_eos), on one engine, so a turn sees what the earlier ones
left in vLLM's prefix cache. OUT: ``{"start_s": s, "conversations": [[{"prompt": [ids],
"tokens": [...], "num_cached_tokens": k, "ttft_s": s, "total_s": s}, ...]]}``.
"""

import json
import sys
import time
from pathlib import Path

from services.engine.vllm.options import prepare_env
from services.engine.vllm.reference import Reference, build_engine, run_one


def converse(engine, turns: list[dict], tag: str) -> list[dict]:
    out: list[dict] = []
    prompt: list[int] = []
    for k, t in enumerate(turns):
        prompt = [*prompt, *out[-1]["tokens"], *t["prompt"]] if out else list(t["prompt"])
        r = run_one(engine, f"{tag}-t{k}", prompt, int(t.get("max_tokens", 1)))
        out.append({"prompt": prompt, **r})
    return out


class ConversationReference(Reference):
    """The runner as a child process: ``.start()`` ... ``.result()`` (``.kill()``)."""

    MODULE = "services.engine.vllm.conversation"
    WHAT = "vLLM conversation reference"
    RESULT_TIMEOUT_S = 900.0

    def __init__(self, spec: dict, workdir: str | Path, name: str = "conversations") -> None:
        super().__init__(spec, workdir, name)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    prepare_env()
    t = time.perf_counter()
    engine = build_engine(spec)
    start_s = time.perf_counter() - t
    run_one(engine, "warmup", [3 + i % 100 for i in range(64)], 2)  # first forward is slow
    convs = [converse(engine, turns, f"c{i}") for i, turns in enumerate(spec["conversations"])]
    Path(argv[1]).write_text(json.dumps({"start_s": start_s, "conversations": convs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
