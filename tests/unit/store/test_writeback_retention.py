"""How the store's retention treats a conversation's last turn (issue 24): the blocks a
decode worker writes back at the end of a turn, and the prompt blocks that write-back
locks on its way, are the node's most recently used, so under pressure older
conversations go first and, within the last turn, the chain's tail before its head; a
context-cache turn pins the answer, and renews the prompt's pin, for ``context_ttl_s``
from the end of the turn. Hand-stepped on a real BlockPool with exact eviction order."""

from bus_schemas.control import TxAllocate, TxRole
from bus_schemas.kv_events import BlockRemoved
from bus_schemas.requests import Retention
from services.common.clock import ManualClock
from services.store.pool.block_pool import BlockPool

BS = 4


def chain(tag: int, n: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def commit(pool: BlockPool, hashes: list[int], *, answer=False, **kw) -> None:
    a = pool.allocate(
        TxAllocate(
            request_id="r",
            role=TxRole.DECODE,
            block_hashes=hashes,
            num_tokens=len(hashes) * BS,
            answer=answer,
            **kw,
        )
    )
    assert not hasattr(a, "reason"), a
    pool.commit(a.tx_id)


def turn(pool: BlockPool, conv: list[int], prompt_blocks: int, **kw) -> None:
    """One turn on the decode node: the prompt's decode_tx, then the answer's write-back."""
    commit(pool, conv[:prompt_blocks], **kw)
    commit(pool, conv, answer=True, **kw)


def removed(pool: BlockPool) -> list[int]:
    return [h for e in pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_the_last_turn_outlives_older_conversations_and_loses_its_tail_first():
    pool = BlockPool(12, BS, ManualClock())
    a, b = chain(1, 5), chain(2, 5)  # 3 prompt blocks + 2 answer blocks each
    turn(pool, a, 3)
    turn(pool, b, 3)
    # a's next turn comes back later: it only locks and releases a's chain again
    turn(pool, a, 5)
    pool.take_events()
    commit(pool, chain(3, 5))  # someone else needs 5 of the 2 free + 10 cached
    # b (the conversation idle longest) goes, tail first; a's last turn stays whole.
    assert removed(pool) == [2004, 2003, 2002]
    assert all(pool.is_cached(h) for h in a)
    # Next: what is left of b, then a's last turn (tail first), then the newcomer.
    assert pool.eviction_order() == [2001, 2000, *reversed(a), *reversed(chain(3, 5))]


def test_eviction_order_puts_a_conversations_answer_behind_its_prompt():
    pool = BlockPool(8, BS, ManualClock())
    a = chain(1, 5)
    turn(pool, a, 3)
    assert pool.eviction_order() == [1004, 1003, 1002, 1001, 1000]


def test_a_context_cache_turn_pins_its_answer_for_the_ttl_from_the_end_of_the_turn():
    clock = ManualClock()
    pool = BlockPool(8, BS, clock)
    a = chain(1, 5)
    commit(pool, a[:3], retention=Retention.CONTEXT_CACHE, context_ttl_s=60)
    clock.advance(30)  # the answer is written back at the end of the turn
    commit(pool, a, answer=True, retention=Retention.CONTEXT_CACHE, context_ttl_s=60)
    clock.advance(45)  # the prompt's first pin (t=60) ran out; the turn's (t=90) holds
    pool.expire()
    assert pool.eviction_order() == []  # every block of the conversation still pinned
    big = pool.allocate(
        TxAllocate(request_id="x", role=TxRole.DECODE, block_hashes=[], num_tokens=4 * BS)
    )
    assert getattr(big, "reason", None) == "capacity"  # 3 free, nothing evictable
    clock.advance(16)
    pool.expire()
    assert pool.eviction_order() == [1004, 1003, 1002, 1001, 1000]
