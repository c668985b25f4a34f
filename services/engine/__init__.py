"""Model runners behind one interface (:mod:`services.engine.base`).

``make_engine("mock", ...)`` gives the cost-model engine with deterministic outputs;
``"vllm"`` (GPU, through vLLM's KV-connector API) is not built yet.
"""

from collections.abc import Awaitable, Callable

from services.common.cost_model import CostModel
from services.common.model_spec import ModelSpec
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
) -> Engine:
    if kind == "mock":
        from services.engine.mock import MockEngine

        return MockEngine(spec, cost, max_batch=max_batch, sleep=sleep)
    if kind == "vllm":
        raise NotImplementedError("vllm backend arrives with issue 3")
    raise ValueError(f"unknown engine {kind!r}; choose from {', '.join(ENGINE_KINDS)}")
