"""Settings of the vLLM backend and the process environment it needs (no vLLM import).

vLLM reads its environment at import time, so :func:`prepare_env` must run before the
first ``import vllm`` (the engine does it in its constructor).
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set (not defaulted): perigee steps vLLM in-process from one thread; the connector
# needs the engine's objects (store slots, event loop) in the same process.
FORCED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
DEFAULT_ENV = {
    # Auto-binding pins the whole in-process engine to core 0 and reserves the others:
    # 10x slower, and a prefill and a decode engine on one machine share core 0.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the block count is set with kv_blocks
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def prepare_env() -> None:
    os.environ.update(FORCED_ENV)
    for k, v in DEFAULT_ENV.items():
        os.environ.setdefault(k, v)


def has_weights(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return d.is_dir() and any(f.suffix in WEIGHT_SUFFIXES for f in d.iterdir())


@dataclass(frozen=True)
class VllmOptions:
    """How to start vLLM. Zero / None fields take a default from the model and role."""

    model_dir: str
    # "auto" loads the directory's weights; "dummy" fills random constants (vLLM's
    # default filler is degenerate: the output hardly depends on the prompt). None:
    # "auto" when the directory holds weights, else "dummy".
    load_format: str | None = None
    dtype: str | None = None  # None: the model's (config.json torch_dtype)
    block_size: int = 0  # vLLM's block; must divide perigee's. 0: 32 if it does, else perigee's
    kv_blocks: int = 0  # num_gpu_blocks_override; 0: by role (a GPU decode engine: vLLM sizes it)
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_num_batched_tokens: int = 0  # 0: max_model_len for prefill, 2048 for decode
    seed: int = 0
    enforce_eager: bool = True
    # CUDA: the fraction of the GPU's memory this engine may take (0: vLLM's default).
    # Engines that share a GPU split it (perigee up does: perigee.gpus).
    gpu_memory_utilization: float = 0.0
    # CUDA: page-lock the store's arena for the connector's copies (kv_pages).
    pin_arena: bool = True

    def resolved_load_format(self) -> str:
        if self.load_format:
            return self.load_format
        return "auto" if has_weights(self.model_dir) else "dummy"

    def vllm_block_size(self, hash_block_size: int) -> int:
        if self.block_size:
            return self.block_size
        return 32 if hash_block_size % 32 == 0 else hash_block_size


def add_arguments(p: Any) -> None:
    """The ``--engine vllm`` flags of the prefill and decode services."""
    g = p.add_argument_group("vllm engine (--engine vllm)")
    g.add_argument(
        "--load-format",
        default=None,
        help="vLLM load format: auto (the model directory's safetensors) or dummy "
        "(random constants); default: auto if the directory holds weights",
    )
    g.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="vLLM paged-cache blocks (0: two max-length sequences for prefill, "
        "at least 1024 for decode)",
    )
    g.add_argument(
        "--vllm-block-size",
        type=int,
        default=0,
        help="vLLM block size; must divide --block-size (0: 32 if it does)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest request served, tokens; the node's store must hold one "
        "(0: the model's max_position_embeddings)",
    )
    g.add_argument("--vllm-seed", type=int, default=0, help="vLLM sampling seed")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="CUDA: fraction of the GPU's memory for this engine (0: vLLM's default, 0.9); "
        "engines sharing a GPU must split it",
    )
    g.add_argument(
        "--pin-arena",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: page-lock the node store's shared memory for the KV copies",
    )


def from_args(args: Any, model_dir: str) -> VllmOptions:
    return VllmOptions(
        model_dir=model_dir,
        load_format=args.load_format,
        kv_blocks=args.kv_blocks,
        block_size=args.vllm_block_size,
        max_model_len=args.max_model_len,
        seed=args.vllm_seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        pin_arena=args.pin_arena,
    )
