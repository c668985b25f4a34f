"""lm-eval through perigee equals lm-eval through plain vLLM (issue 25): the harness's
``local-completions`` model (loglikelihood requests: completions with ``echo``,
``logprobs=1``, ``max_tokens=1``) runs the repository's multiple-choice task
(``tests/lmeval/perigee_mc.yaml``, data in ``tests/lmeval/data``) against a perigee stack
(1 prefill + 1 decode, vLLM) and then against vLLM's own OpenAI server on the same model:
the same accuracy, and every choice's log-likelihood within float tolerance with the same
``is_greedy``. lm-eval lives in a venv of its own (``make install-lmeval``); the two
servers run one after the other (two engines on two cores would compete).
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from perigee import models
from perigee.natsd import free_port
from services.engine.vllm.options import DEFAULT_ENV, FORCED_ENV
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import real_model_marks

ROOT = Path(__file__).resolve().parents[2]
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
MODEL_DIR = models.default_model_dir()
NAME = models.DEFAULT_MODEL_NAME
TOL = 5e-3  # a sum of a few float32 logprobs, batch shapes differ

pytestmark = [
    *real_model_marks(),
    pytest.mark.skipif(
        not LM_EVAL.exists(), reason="lm-eval is not installed (make install-lmeval)"
    ),
]


def run_lm_eval(base_url: str, out: Path) -> tuple[float, list[tuple[int, list]]]:
    """(accuracy, [(doc id, [[loglikelihood, is_greedy] per choice])])."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = ",".join(
        [
            f"model={NAME}",
            f"base_url={base_url}/v1/completions",
            f"tokenizer={MODEL_DIR}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    proc = subprocess.run(
        [
            str(LM_EVAL),
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--tasks",
            "perigee_mc",
            "--include_path",
            "tests/lmeval",
            "--batch_size",
            "1",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = next(out.rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"]["perigee_mc"]["acc,none"]
    samples = next(out.rglob("samples_perigee_mc_*.jsonl"))
    items = []
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        items.append((s["doc_id"], [r[0] for r in s["resps"]]))
    return acc, sorted(items)


class VllmServer:
    """vLLM's own OpenAI server (``vllm serve``) on the model, float32 as perigee's."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **DEFAULT_ENV, **FORCED_ENV}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server of its own: its default
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(MODEL_DIR),
                "--served-model-name",
                NAME,
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--dtype",
                "float32",
                "--max-model-len",
                "2048",
                "--enforce-eager",
                "--seed",
                "0",
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm serve exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # polling an external process's readiness, not synchronising
        raise TimeoutError("vllm serve did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def test_lm_eval_through_perigee_equals_plain_vllm(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "lmeval",
        engine="vllm",
        prefill=1,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        speedup="0.1",
        tbt_slo=1.0,
        store_capacity_blocks=512,
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        acc_p, items_p = run_lm_eval(s.url, tmp_path_factory.mktemp("lmeval-perigee"))
    finally:
        s.stop()
    logs = tmp_path_factory.mktemp("vllm-serve")
    v = VllmServer(logs / "vllm.log")
    try:
        v.wait_ready()
        acc_v, items_v = run_lm_eval(v.url, tmp_path_factory.mktemp("lmeval-vllm"))
    finally:
        v.stop()
    assert len(items_p) == len(items_v) == 16
    assert acc_p == acc_v
    assert acc_v >= 0.5  # the model answers most: the scores are real, not noise
    for (doc_p, resp_p), (doc_v, resp_v) in zip(items_p, items_v, strict=True):
        assert doc_p == doc_v and len(resp_p) == len(resp_v) == 4
        for (ll_p, greedy_p), (ll_v, greedy_v) in zip(resp_p, resp_v, strict=True):
            assert float(ll_p) == pytest.approx(float(ll_v), abs=TOL), doc_p
            assert greedy_p == greedy_v, doc_p
