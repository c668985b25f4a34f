"""Model runners behind one interface (:mod:`services.engine.base`).

``make_engine("mock", ...)`` gives the cost-model engine with deterministic outputs;
``make_engine("vllm", ..., role=..., layout=..., vllm=VllmOptions(...))`` runs vLLM
in-process (CPU or GPU) with :class:`services.engine.vllm.connector.PerigeeConnector`
moving KV between the node store's slots and vLLM's paged cache. vLLM is imported
only when that engine starts.
"""

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from bus_schemas.roles import Role
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.engine.base import (
    DecodeJob,
    Engine,
    EngineDeadError,
    EngineError,
    EngineStats,
    KVAccess,
    PrefillJob,
    RequestStream,
    SlotKV,
)

if TYPE_CHECKING:
    from services.engine.vllm.options import VllmOptions

ENGINE_KINDS = ("mock", "vllm")

__all__ = [
    "ENGINE_KINDS",
    "DecodeJob",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "KVAccess",
    "PrefillJob",
    "RequestStream",
    "SlotKV",
    "make_engine",
]


def make_engine(
    kind: str,
    spec: ModelSpec,
    cost: CostModel,
    *,
    max_batch: int = 128,
    sleep: Callable[[float], Awaitable[object]] | None = None,
    role: str = Role.DECODE,
    layout: KVLayout | None = None,
    vllm: "VllmOptions | None" = None,
) -> Engine:
    """``role`` (a :class:`Role`), ``layout`` (perigee block size and the store's
    block bytes) and ``vllm`` (model directory, load format, ...) are for "vllm"."""
    if kind == "mock":
        from services.engine.mock import MockEngine

        return MockEngine(spec, cost, max_batch=max_batch, sleep=sleep)
    if kind == "vllm":
        from services.engine.vllm.engine import VllmEngine
        from services.engine.vllm.options import VllmOptions

        layout = layout or KVLayout(spec, 32)
        return VllmEngine(
            spec,
            vllm or VllmOptions(model_dir=str(DEFAULT_MODEL_DIR)),
            role=role,
            hash_block_size=layout.block_size,
            block_bytes=layout.block_bytes,
            max_batch=max_batch,
        )
    raise ValueError(f"unknown engine {kind!r}; choose from {', '.join(ENGINE_KINDS)}")
