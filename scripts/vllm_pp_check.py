"""Issue 16 item 4: does vLLM's own pipeline parallelism run on this build?

    .venv/bin/python scripts/vllm_pp_check.py [MODEL_DIR] [--eager]

Starts ``LLM(pipeline_parallel_size=2, distributed_executor_backend="mp")`` on the
default model (``perigee model path``) and asks for 8 greedy tokens. Prints ``PP2 OK``
with the text, or ``PP2 FAILED`` after the traceback. On a machine with one NUMA node
set ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``0|1``): vLLM's automatic binding wants one
NUMA node per rank. One engine at a time: check ``pgrep -fa "vllm|EngineCore"`` first.
"""

import os
import subprocess
import sys
import time
import traceback


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = (
        args[0]
        if args
        else subprocess.check_output(
            [sys.executable, "-c", "from perigee.cli import main; main()", "model", "path"],
            text=True,
        )
        .strip()
        .splitlines()[-1]
    )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=model,
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            max_model_len=1024,
            enforce_eager="--eager" in sys.argv,
            dtype="float32",
        )
        out = llm.generate(
            ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0)
        )
        print("PP2 OK", repr(out[0].outputs[0].text), f"{time.time() - t0:.0f}s", flush=True)
        return 0
    except Exception:
        traceback.print_exc()
        print("PP2 FAILED", f"{time.time() - t0:.0f}s", flush=True)
        return 1


if __name__ == "__main__":  # vLLM's mp workers re-import this module (spawn)
    sys.exit(main())
