"""A plain, monolithic vLLM engine run over a list of prompts (tests' reference, benches'
baseline): ``python -m services.engine.vllm.reference SPEC.json OUT.json``.

SPEC: ``{"model_dir": str, "load_format": str|null, "prefix_caching": bool,
"kv_blocks": int, "max_model_len": int, "block_size": int, "max_num_batched_tokens": int,
"gpu_memory_utilization": float (CUDA; absent: REFERENCE_GPU_SHARE),
"requests": [{"prompt": [ids], "max_tokens": n, "sampling": {...}}]}``. Requests run one
after another, greedy (temperature 0, ignore_eos), so each sees whatever the previous
ones left in vLLM's prefix cache; a request's ``sampling`` adds vLLM ``SamplingParams``
fields (``bad_words_token_ids``: the tokenized bad words, as the engines get them).
OUT: ``{"start_s": s, "results": [{"tokens": [...], "num_cached_tokens": k, "ttft_s": s,
"total_s": s, "logprobs": [...] | null, "prompt_logprobs": [...] | null}]}``, logprobs
as ``[token id, logprob]`` pairs per position in vLLM's order. JSON both ways (no
pickle), no connector: this is vLLM as it ships.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from services.engine.vllm.options import VllmOptions, prepare_env

REFERENCE_GPU_SHARE = 0.05  # of the card (7 GB of an H200); vLLM ignores it on CPU


def build_engine(spec: dict):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    opts = VllmOptions(model_dir=spec["model_dir"], load_format=spec.get("load_format"))
    max_len = int(spec.get("max_model_len") or 8192)
    bs = int(spec.get("block_size") or 32)
    # On a GPU the reference runs beside a stack's engines on the same card: its own
    # small share (the stack's engines split perigee.gpus.TOTAL_SHARE).
    gpu = float(spec.get("gpu_memory_utilization") or REFERENCE_GPU_SHARE)
    return LLMEngine.from_engine_args(
        EngineArgs(
            gpu_memory_utilization=gpu,
            model=opts.model_dir,
            skip_tokenizer_init=True,
            load_format=opts.resolved_load_format(),
            dtype=spec.get("dtype") or "float32",
            block_size=bs,
            max_model_len=max_len,
            max_num_seqs=4,
            max_num_batched_tokens=int(spec.get("max_num_batched_tokens") or max_len),
            num_gpu_blocks_override=int(spec.get("kv_blocks") or 2 * (-(-max_len // bs) + 1)),
            enable_prefix_caching=bool(spec.get("prefix_caching", False)),
            enforce_eager=True,
            seed=0,
            distributed_executor_backend="uni",
            disable_log_stats=True,
        )
    )


def _pairs(position) -> list | None:
    return None if position is None else [[t, lp.logprob] for t, lp in position.items()]


def run_one(
    engine, rid: str, prompt: list[int], max_tokens: int, sampling: dict | None = None
) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    extra = dict(sampling or {})
    bad_words = extra.pop("bad_words_token_ids", None)
    if extra.get("logit_bias"):  # JSON made the token ids strings
        extra["logit_bias"] = {int(t): b for t, b in extra["logit_bias"].items()}
    params = SamplingParams(
        **{
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "detokenize": False,
            "output_kind": RequestOutputKind.DELTA,
            **extra,
        }
    )
    if bad_words:
        params._bad_words_token_ids = bad_words
    logprobs: list | None = [] if params.logprobs is not None else None
    prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    tokens: list[int] = []
    ttft = None
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = list(out.outputs[0].token_ids)
            if logprobs is not None and out.outputs[0].logprobs:
                logprobs += [_pairs(p) for p in out.outputs[0].logprobs]
            if prompt_logprobs is not None and out.prompt_logprobs:
                prompt_logprobs += [_pairs(p) for p in out.prompt_logprobs]
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += new
            cached = max(cached, out.num_cached_tokens or 0)
    return {
        "tokens": tokens,
        "num_cached_tokens": cached,
        "ttft_s": ttft,
        "total_s": time.perf_counter() - t0,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }


class Reference:
    """The runner as a child process: ``Reference(spec, workdir).start()`` ... ``.result()``.
    A subclass names another runner module (``MODULE``, same SPEC/OUT arguments)."""

    MODULE = "services.engine.vllm.reference"
    WHAT = "vLLM reference"
    RESULT_TIMEOUT_S = 600.0

    def __init__(self, spec: dict, workdir: str | Path, name: str = "reference") -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec_path = self.dir / f"{name}-spec.json"
        self.out_path = self.dir / f"{name}-out.json"
        self.log_path = self.dir / f"{name}.log"
        self.spec_path.write_text(json.dumps(spec))
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Reference":
        root = Path(__file__).resolve().parents[3]
        env = {**os.environ, "PYTHONPATH": str(root)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.MODULE, str(self.spec_path), str(self.out_path)],
                cwd=root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def result(self, timeout: float | None = None) -> dict:
        assert self.proc is not None, "start() first"
        rc = self.proc.wait(timeout=self.RESULT_TIMEOUT_S if timeout is None else timeout)
        if rc != 0 or not self.out_path.exists():
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.WHAT} exited with {rc}:\n{tail}")
        return json.loads(self.out_path.read_text())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    prepare_env()
    t = time.perf_counter()
    engine = build_engine(spec)
    start_s = time.perf_counter() - t
    run_one(engine, "warmup", [3 + i % 100 for i in range(64)], 2)  # first forward is slow
    results = [
        run_one(engine, f"r{i}", list(r["prompt"]), int(r.get("max_tokens", 1)), r.get("sampling"))
        for i, r in enumerate(spec["requests"])
    ]
    Path(argv[1]).write_text(json.dumps({"start_s": start_s, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
