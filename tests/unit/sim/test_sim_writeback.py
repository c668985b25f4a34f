"""Decode write-back in the simulator (issue 24): the next-turn rule on hand-made traces,
and a simulated next turn finding its previous answer's blocks cached."""

import json

import pytest

from perigee.sim.repro_multiturn import multiturn
from perigee.sim.simulator import SimConfig, Simulator
from perigee.sim.writeback import SimWriteBack, coverage, infer_answers
from perigee.trace import TraceRequest

B = 512
SYS = 0  # a block every request starts with (a shared system prompt)


def req(t: float, blocks: list[int], tail: int, out: int) -> TraceRequest:
    """``blocks`` full blocks, then ``tail`` more tokens in a last partial block (id -t)."""
    ids = tuple(blocks) + ((10_000 + int(t),) if tail else ())
    return TraceRequest(t, len(blocks) * B + tail, out, ids)


def test_a_next_turn_extends_every_full_block_and_grows_by_the_output():
    turn1 = req(0, [SYS, 1, 2], 100, 1100)  # answer: positions [1636, 2736)
    turn2 = req(60, [SYS, 1, 2, 3, 4, 5, 6], 50, 10)  # holds turn 1 + its answer + more
    answers = infer_answers([turn1, turn2])
    # Blocks with KV after turn 1: (1636 + 1100 - 1) // 512 = 5, of which 3 are the prompt's.
    assert answers == {0: [3, 4]}


def test_a_shared_system_prompt_alone_is_no_conversation():
    a = req(0, [SYS], 300, 400)  # one full block: the system prompt every request has
    b = req(5, [SYS, 7, 8, 9], 10, 5)
    assert infer_answers([a, b]) == {}
    assert infer_answers([a, b], min_shared=1) == {0: [7]}  # the loose rule would pair them


def test_too_short_to_hold_the_answer_or_already_continued_is_not_a_next_turn():
    a = req(0, [SYS, 1, 2], 0, 2000)
    short = req(10, [SYS, 1, 2, 3], 400, 5)  # 1936 < 1536 + 2000
    assert infer_answers([a, short]) == {}
    b = req(20, [SYS, 1, 2, 3, 4, 5, 6, 7], 0, 5)
    c = req(30, [SYS, 1, 2, 3, 4, 5, 6, 8], 0, 5)  # a second continuation of a: b took it
    assert infer_answers([a, b, c]) == {0: [3, 4, 5]}
    cov = coverage([a, b, c])
    assert (cov.with_next_turn, cov.with_answer_blocks, cov.answer_blocks) == (1, 1, 3)


def test_the_longest_shared_prefix_wins():
    a = req(0, [SYS, 1], 0, 600)
    b = req(1, [SYS, 1, 2, 3], 0, 600)  # a's next turn, and a conversation of its own
    c = req(50, [SYS, 1, 2, 3, 4, 5, 6], 0, 5)  # extends a's and b's: b's is longer
    assert infer_answers([a, b, c]) == {0: [2], 1: [4]}


def conversation() -> list[TraceRequest]:
    # Two turns; each turn's prompt is large enough that the answer's block matters.
    return [
        req(0, [SYS, 1, 2, 3, 4, 5, 6, 7], 0, 1025),  # answer: blocks 8, 9 ((5121 - 1) // 512)
        req(120, [SYS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 20], 0, 10),
    ]


@pytest.mark.parametrize("wb", [False, True])
def test_the_next_turn_finds_the_answer_cached_only_with_write_back(wb):
    cfg = SimConfig(prefill=2, decode=2, decode_writeback=wb)
    sim = Simulator(conversation(), cfg).run()
    t2 = sim.requests[1]
    assert t2.state == "DONE"
    assert t2.cached_tokens == (10 if wb else 8) * B
    if wb:
        assert sim.writeback.stats["blocks"] == 2 and sim.writeback.stats["followed_blocks"] == 2
        hits = sum(n.pool.counters["answer_hits_dram"] for n in sim.cluster.nodes.values())
        assert hits >= 2  # the next turn's prefill (and its decode tx) found them


def test_write_back_needs_the_traces_block_size():
    with pytest.raises(ValueError, match="--block-size 512"):
        Simulator(conversation(), SimConfig(block_size=64, decode_writeback=True))
    assert SimWriteBack  # the class the simulator builds


def test_repro_multiturn_writes_its_table_and_figure(tmp_path):
    res = multiturn(conversation(), str(tmp_path), speeds=(1.0,), capacities=(4096,))
    runs = res["runs"]
    assert runs["x1-writeback"]["next_turns"]["cache_hit_rate"] == pytest.approx(10 / 11)
    assert runs["x1-none"]["next_turns"]["cache_hit_rate"] == pytest.approx(8 / 11)
    assert (tmp_path / "sim_multiturn.png").stat().st_size > 0
    assert "| x1 | 3M | on |" in res["table"]
    assert runs["x1-writeback"]["next_turns"]["whole_answer_cached"] == 1
    # A store of 8 blocks per node cannot keep turn 1's 10 blocks for turn 2.
    assert runs["x1-writeback-4k"]["next_turns"]["whole_answer_cached"] == 0
    json.dumps(res)  # what repro writes
