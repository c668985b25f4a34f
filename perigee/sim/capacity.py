"""Cache hit rate against cache capacity from the request sequence alone (paper Fig. 16:
"we consider only the sequence of requests and do not account for prefill computation
time or the replication of hotspots").

One store (the real :class:`BlockPool`, LRU) of the given capacity sees every request
in arrival order as one PREFILL transaction, committed at once; a request's hit is its
longest cached prefix. ``capacity_tokens=None`` is the unbounded cache, i.e. the
theoretical maximum hit rate of the trace.
"""

from collections.abc import Sequence

from bus_schemas.control import TxAllocate, TxDone, TxRole
from perigee.trace import TRACE_BLOCK, TraceRequest
from services.common.clock import ManualClock
from services.store.pool.block_pool import Allocation, BlockPool


def hit_rate(
    trace: Sequence[TraceRequest], capacity_tokens: int | None, block_size: int = TRACE_BLOCK
) -> float:
    """Cached prompt tokens / prompt tokens over ``trace`` with one LRU cache."""
    total_blocks = sum(-(-r.input_length // block_size) for r in trace)
    cap = total_blocks + 1 if capacity_tokens is None else max(1, capacity_tokens // block_size)
    pool = BlockPool(cap, block_size, ManualClock(), kv_events=False)  # nobody indexes them
    cached = prompt = 0
    for i, r in enumerate(trace):
        n = r.input_length
        prompt += n
        full = list(r.hash_ids[: n // block_size])
        tx = pool.allocate(
            TxAllocate(
                request_id=str(i),
                role=TxRole.PREFILL,
                block_hashes=full,
                num_tokens=n,
                lease_s=1e12,
            )
        )
        if not isinstance(tx, Allocation):  # larger than the whole cache: only hits count
            cached += min(n, pool.prefix_hits(full) * block_size)
            continue
        cached += min(n, tx.hit_blocks * block_size)
        done = pool.commit(tx.tx_id)
        assert isinstance(done, TxDone)
    return cached / prompt if prompt else 0.0
