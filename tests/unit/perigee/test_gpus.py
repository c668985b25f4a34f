"""perigee up on GPUs: engines spread over the cards, each card's memory share split
among the engines on it, and what each worker is given parses in its own service."""

import importlib

import pytest

from perigee import gpus
from perigee.stack import Stack
from perigee.up import parse


def test_spread_round_robin_and_split_per_card():
    assert gpus.spread(2, 1) == [gpus.GpuSlot(0, 0.4), gpus.GpuSlot(0, 0.4)]
    assert gpus.spread(3, 2) == [gpus.GpuSlot(0, 0.4), gpus.GpuSlot(1, 0.8), gpus.GpuSlot(0, 0.4)]
    assert gpus.spread(2, 2, total=0.5) == [gpus.GpuSlot(0, 0.5), gpus.GpuSlot(1, 0.5)]
    assert gpus.spread(0, 1) == []
    for bad in ((1, 0, 0.9), (-1, 1, 0.9), (1, 1, 0.0), (1, 1, 1.5)):
        with pytest.raises(ValueError):
            gpus.spread(*bad)


def workers(cfg) -> list:
    return [c for c in Stack(cfg).plan() if c.name.startswith(("prefill", "decode"))]


def test_vllm_workers_get_their_card_and_share(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    cfg = parse(["--engine", "vllm", "--model", "tiny-llama", "--prefill", "2", "--decode", "1"])
    got = [(c.name, c.env["CUDA_VISIBLE_DEVICES"], c.argv[-2:]) for c in workers(cfg)]
    assert got == [
        ("prefill-0", "3", ["--gpu-memory-utilization", "0.4"]),
        ("prefill-1", "5", ["--gpu-memory-utilization", "0.8"]),
        ("decode-0", "3", ["--gpu-memory-utilization", "0.4"]),
    ]
    for c in workers(cfg):  # each service's own parser takes what it is given
        module, *argv = c.argv
        args = importlib.import_module(f"{module}.__main__").parse_args(argv)
        assert args.gpu_memory_utilization in (0.4, 0.8) and args.pin_arena


def test_one_card_split_by_the_given_share(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = parse(["--engine", "vllm", "--model", "tiny-llama", "--gpu-memory-utilization", "0.6"])
    assert [(c.env["CUDA_VISIBLE_DEVICES"], c.argv[-1]) for c in workers(cfg)] == [
        ("0", "0.3"),
        ("0", "0.3"),
    ]


def test_no_card_or_mock_engine_leaves_workers_alone(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for engine in ("vllm", "mock"):
        cfg = parse(["--engine", engine, "--model", "tiny-llama"])
        for c in workers(cfg):
            assert "CUDA_VISIBLE_DEVICES" not in c.env
            assert "--gpu-memory-utilization" not in c.argv
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for c in workers(parse(["--engine", "mock", "--model", "tiny-llama"])):
        assert "--gpu-memory-utilization" not in c.argv


def gateway_env(cfg) -> dict[str, str]:
    return next(c.env for c in Stack(cfg).plan() if c.name == "gateway")


def test_the_overhead_gate_is_off_only_for_engines_on_the_cpu(monkeypatch):
    # vLLM on CPU computes on the control plane's cores: its overhead is no backlog's.
    monkeypatch.delenv("PERIGEE_MAX_OVERHEAD_MS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cpu = parse(["--engine", "vllm", "--model", "tiny-llama"])
    assert gateway_env(cpu)["PERIGEE_MAX_OVERHEAD_MS"] == "0"
    assert all("PERIGEE_MAX_OVERHEAD_MS" not in c.env for c in workers(cpu))
    # The mock engine and vLLM on a card leave it at the gateway's default (on).
    assert "PERIGEE_MAX_OVERHEAD_MS" not in gateway_env(parse(["--engine", "mock"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu = parse(["--engine", "vllm", "--model", "tiny-llama"])
    assert "PERIGEE_MAX_OVERHEAD_MS" not in gateway_env(gpu)
    # What the user set wins, on CPU too.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PERIGEE_MAX_OVERHEAD_MS", "20")
    assert "PERIGEE_MAX_OVERHEAD_MS" not in gateway_env(cpu)
