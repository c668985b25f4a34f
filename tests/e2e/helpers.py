import asyncio
import importlib.util

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import WorkerStats
from perigee import models


def real_model_marks() -> list[pytest.MarkDecorator]:
    """An e2e test on the default real model through vLLM: skipped, saying how to install
    what is missing, where vLLM or the prepared model is not there."""
    model_dir = models.default_model_dir()
    return [
        pytest.mark.e2e,
        pytest.mark.skipif(
            importlib.util.find_spec("vllm") is None,
            reason="vLLM is not installed (make install-vllm)",
        ),
        pytest.mark.skipif(
            not models.is_prepared(model_dir),
            reason=f"{models.DEFAULT_MODEL_NAME} is not prepared in {model_dir} "
            "(make install, or perigee model prepare)",
        ),
    ]


async def worker_stats(nats_url: str, role: str, instance: str) -> dict[str, int]:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(subjects.worker_stats(role, instance), b"{}", timeout=5)
        return decode(msg.data, WorkerStats).counters
    finally:
        await nc.close()


class KVEventWatcher:
    """Collects every block hash stored anywhere, so a test can wait for a commit."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self._changed = asyncio.Event()
        self.nc = None

    async def start(self, nats_url: str) -> "KVEventWatcher":
        self.nc = await nats.connect(nats_url)

        async def cb(m):
            batch = decode(m.data, EventBatch)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self.stored.update(ev.block_hashes)
            self._changed.set()

        await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=cb)
        return self

    async def wait_for(self, hashes, timeout: float = 20.0) -> None:
        async def loop():
            while not set(hashes) <= self.stored:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), timeout)

    async def close(self) -> None:
        await self.nc.close()


__all__ = ["worker_stats", "KVEventWatcher", "encode"]


def chat_ids(hf, chats: dict[str, list[dict]]) -> dict[str, list[int]]:
    """Each chat's prompt ids by transformers' own chat template (a reference's input)."""
    return {
        k: hf.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False)
        for k, m in chats.items()
    }
