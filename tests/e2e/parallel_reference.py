"""Monolithic vLLM's parallel sampling as a child process (``Reference`` subclass):
``vllm.LLM`` on the model, one ``generate`` per request with ``SamplingParams(n=...,
seed=...)`` as given. SPEC/OUT as services.engine.vllm.reference, but each result is
``{"seqs": [[token ids of child 0], [child 1], ...], "logprobs": [per child: [per
position: [[token id, logprob], ...]]] or [None, ...]}`` (by the child's index)."""

import json
import sys
from pathlib import Path

from services.engine.vllm.options import VllmOptions, prepare_env
from services.engine.vllm.reference import Reference


class ParallelReference(Reference):
    MODULE = "tests.e2e.parallel_reference"
    WHAT = "vLLM parallel-sampling reference"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    prepare_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    opts = VllmOptions(model_dir=spec["model_dir"])
    max_len = int(spec.get("max_model_len") or 8192)
    llm = LLM(
        model=opts.model_dir,
        skip_tokenizer_init=True,
        load_format=opts.resolved_load_format(),
        dtype="float32",
        block_size=32,
        max_model_len=max_len,
        max_num_seqs=8,
        max_num_batched_tokens=max_len,
        num_gpu_blocks_override=4 * (-(-max_len // 32) + 1),
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        disable_log_stats=True,
    )
    results = []
    for r in spec["requests"]:
        params = SamplingParams(detokenize=False, **r["sampling"])
        [out] = llm.generate(
            [TokensPrompt(prompt_token_ids=list(r["prompt"]))], params, use_tqdm=False
        )
        seqs = sorted(out.outputs, key=lambda o: o.index)
        lps = [
            [[[t, lp.logprob] for t, lp in pos.items()] for pos in o.logprobs]
            if o.logprobs
            else None
            for o in seqs
        ]
        results.append({"seqs": [list(o.token_ids) for o in seqs], "logprobs": lps})
    Path(argv[1]).write_text(json.dumps({"start_s": 0.0, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
