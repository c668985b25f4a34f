"""Decode write-back in the simulator (issue 24), and ``perigee sim repro multiturn``.

The live decode worker writes each whole block of an answer into its node's store and
on to the prefill node that holds the prompt (services.decode.writeback). A trace has
no answers, only each request's blocks, and no session ids, so which later request is
an earlier one's next turn, and so which blocks were its answer, must be inferred.

The rule (:func:`infer_answers`). Request ``j`` is the next turn of an earlier request
``i`` when

* ``j``'s blocks start with every full block of ``i`` (``i.input_length // B`` of
  them, ``B`` the trace's 512 tokens), and there are at least ``min_shared`` of them
  (2 by default: every request of the conversation trace begins with the same block,
  a shared system prompt, and a rule that accepts one shared block pairs requests
  that share nothing else: 12,014 of 12,031 requests extend some earlier request's
  full blocks, 4,914 even when each earlier request may be continued only once);
* ``j``'s prompt is at least ``i``'s prompt plus ``i``'s output long (the answer fits);
* ``i`` is not already some earlier request's predecessor (a turn is continued once);
* among the candidates, the one sharing the most blocks, then the latest.

The answer's blocks are then ``j``'s blocks right after the shared ones, up to the
last block of ``i``'s prompt + answer whose every position has KV
(``(i.input_length + i.output_length - 1) // B``, capped by ``j``'s full blocks).
On the conversation trace this pairs 3,560 of 12,031 requests (29.6 %) with a
predecessor and names 2,483 answer blocks (:func:`coverage`). What it cannot see: a
next turn that rewrote the history (it extends nothing), and an unrelated request that
happens to extend a conversation's full blocks by its output length (a false pair: it
would find the inferred answer blocks cached, which the live system would not).

When the request finishes decoding, :class:`SimWriteBack` does what the live worker
does, in one round (the live one writes as blocks fill, over in the time the answer
takes; a next turn arrives minutes later): a TxAllocate DECODE ``writeback`` of the
prompt's full blocks plus the answer's on the decode node, committed, and the same on
the prefill node when it still holds the prompt. The transfer to the prefill node is
not timed (a few blocks, off every request's critical path).
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from bus_schemas.control import Refused, TxAllocate, TxRole
from perigee.sim.cluster import LEASE_S, Cluster
from perigee.sim.request import SimRequest
from perigee.trace import TRACE_BLOCK, TraceRequest

MIN_SHARED = 2


def infer_answers(
    trace: Sequence[TraceRequest], block: int = TRACE_BLOCK, min_shared: int = MIN_SHARED
) -> dict[int, list[int]]:
    """Request index -> its answer's block hashes, for each request whose next turn the
    module's rule finds (only those with at least one answer block)."""
    return _infer(trace, block, min_shared)[0]


def _infer(
    trace: Sequence[TraceRequest], block: int, min_shared: int
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(the answers, each paired request's next turn: index -> index)."""
    by_full: dict[tuple[int, ...], list[int]] = defaultdict(list)  # full blocks -> requests
    nxt: dict[int, int] = {}
    answers: dict[int, list[int]] = {}
    for j, t in enumerate(trace):
        h, full_j = t.hash_ids, t.input_length // block
        found = None
        for k in range(min(len(h), full_j), min_shared - 1, -1):
            for i in reversed(by_full.get(tuple(h[:k]), ())):
                ti = trace[i]
                if i not in nxt and t.input_length >= ti.input_length + ti.output_length:
                    found = (i, k)
                    break
            if found:
                break
        if found:
            i, k = found
            nxt[i] = j
            ti = trace[i]
            end = min((ti.input_length + ti.output_length - 1) // block, full_j)
            if end > k:
                answers[i] = list(h[k:end])
        if full_j >= 1:
            by_full[tuple(h[:full_j])].append(j)
    return answers, nxt


@dataclass(frozen=True)
class Coverage:
    """How many requests the next-turn rule pairs, and the answer blocks it finds."""

    requests: int
    with_next_turn: int  # requests the rule pairs with a predecessor
    with_answer_blocks: int  # of those, predecessors whose answer fills a block
    answer_blocks: int

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "with_next_turn": self.with_next_turn,
            "with_answer_blocks": self.with_answer_blocks,
            "answer_blocks": self.answer_blocks,
            "fraction_paired": self.with_next_turn / self.requests if self.requests else 0.0,
        }


def coverage(
    trace: Sequence[TraceRequest], block: int = TRACE_BLOCK, min_shared: int = MIN_SHARED
) -> Coverage:
    """How much of ``trace`` the rule covers."""
    answers, nxt = _infer(trace, block, min_shared)
    return Coverage(
        requests=len(trace),
        with_next_turn=len(nxt),
        with_answer_blocks=len(answers),
        answer_blocks=sum(len(a) for a in answers.values()),
    )


class SimWriteBack:
    """The decode worker's write-back for the simulator: ``on_decoded`` after each
    request's last token."""

    def __init__(self, trace: Sequence[TraceRequest], cluster: Cluster, block: int) -> None:
        if block != TRACE_BLOCK:
            raise ValueError(
                f"--decode-writeback infers answers from the trace's {TRACE_BLOCK}-token "
                f"blocks; run it with --block-size {TRACE_BLOCK}, not {block}"
            )
        self.cluster = cluster
        self.answers = infer_answers(trace, block)
        self.stats = dict.fromkeys(
            ("requests", "blocks", "followed_blocks", "broken", "refused"), 0
        )

    def on_decoded(self, req: SimRequest) -> None:
        answer = self.answers.get(req.index)
        if not answer:
            return
        self.stats["requests"] += 1
        chain = [*req.hashes, *answer]
        first = len(req.hashes)
        new = self._write(req, req.decode_node, chain, first)
        if new is None:
            return
        self.stats["blocks"] += new
        if req.prefill_node and req.prefill_node != req.decode_node:
            self.stats["followed_blocks"] += self._write(req, req.prefill_node, chain, first) or 0

    def _write(self, req: SimRequest, node: str, chain: list[int], first: int) -> int | None:
        """Blocks newly cached on ``node`` (None: nothing written)."""
        pool = self.cluster.nodes[node].pool
        if pool is None:
            return None
        a = pool.allocate(
            TxAllocate(
                request_id=req.rid,
                role=TxRole.DECODE,
                block_hashes=chain,
                num_tokens=len(chain) * self.cluster.block_size,
                lease_s=LEASE_S,
                answer=True,
            )
        )
        if isinstance(a, Refused):
            self.stats["refused"] += 1
            return None
        if a.hit_blocks < first:  # the prompt left this node: the answer cannot be matched
            pool.abort(a.tx_id)
            self.stats["broken"] += 1
            return None
        done = pool.commit(a.tx_id)
        return 0 if isinstance(done, Refused) else done.stored_blocks


def writeback_hits(cluster: Cluster) -> dict[str, int]:
    """Hits on written-back blocks over every node's store, by tier."""
    out: dict[str, int] = {}
    for n in cluster.nodes.values():
        if n.pool is None:
            continue
        for k, v in n.pool.counters.items():
            if k.startswith("answer_hits_"):
                tier = k.removeprefix("answer_hits_")
                out[tier] = out.get(tier, 0) + v
    return out
