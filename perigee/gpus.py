"""Which GPU each vLLM engine of a local stack runs on, and its share of that GPU's memory.

vLLM takes ``gpu_memory_utilization`` (0.9 by default) of the whole card for each
engine, so a second engine on the same card fails to start. ``perigee up`` spreads the
engines over the cards ``nvidia-smi -L`` lists, round robin (``CUDA_VISIBLE_DEVICES``),
and gives the engines that share a card equal parts of ``total`` (0.8: the rest is left
for another process, such as the tests' monolithic reference, REFERENCE_GPU_SHARE)."""

import subprocess
from dataclasses import dataclass

TOTAL_SHARE = 0.8


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without a driver or a card)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@dataclass(frozen=True)
class GpuSlot:
    """One engine's card (an index for CUDA_VISIBLE_DEVICES) and memory share."""

    device: int
    share: float

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(self.device)}

    def args(self) -> list[str]:
        return ["--gpu-memory-utilization", f"{self.share:g}"]


def spread(engines: int, gpus: int, total: float = TOTAL_SHARE) -> list[GpuSlot]:
    """Engine ``i`` on card ``i % gpus``; each card's ``total`` split among its engines."""
    if engines < 0 or gpus < 1:
        raise ValueError("need engines >= 0 and gpus >= 1")
    if not 0 < total <= 1:
        raise ValueError("the memory share must be in (0, 1]")
    per_card = [sum(1 for i in range(engines) if i % gpus == g) for g in range(gpus)]
    return [GpuSlot(i % gpus, round(total / per_card[i % gpus], 3)) for i in range(engines)]
