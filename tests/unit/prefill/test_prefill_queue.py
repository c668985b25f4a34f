import pytest

from bus_schemas.placement import PrefillTask, PrefixSource
from bus_schemas.requests import GenerateRequest
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.prefill.queue import BadTask, PrefillQueue, prefix_tokens

BB = 1024
COST = CostModel()


def task(rid: str, n: int, hit: int = 0, remote: tuple[int, int] | None = None) -> PrefillTask:
    src = PrefixSource(node="r0", first_block=remote[0], num_blocks=remote[1]) if remote else None
    return PrefillTask(
        request=GenerateRequest(request_id=rid, prompt_token_ids=[7] * n),
        conductor_id="c",
        prefill_instance="p",
        decode_instance="d",
        prefill_node="p0",
        decode_node="d0",
        expected_hit_blocks=hit,
        source=src,
    )


def test_prefix_tokens_from_local_hit_and_remote_pull():
    assert prefix_tokens(task("a", 100), 32) == 0
    assert prefix_tokens(task("a", 100, hit=2), 32) == 64
    assert prefix_tokens(task("a", 100, hit=1, remote=(1, 2)), 32) == 96
    assert prefix_tokens(task("a", 96, hit=0, remote=(0, 3)), 32) == 96
    assert prefix_tokens(task("a", 100, hit=2, remote=(0, 1)), 32) == 64
    with pytest.raises(BadTask, match="remote prefix starts at block 2"):
        prefix_tokens(task("a", 100, hit=1, remote=(2, 1)), 32)


def test_fifo_one_running_and_load_accounting():
    clock = ManualClock(10.0)
    q = PrefillQueue(COST, clock, 32)
    a = q.push(task("a", 100))
    clock.advance(1.0)
    q.push(task("b", 200, hit=2))
    with pytest.raises(BadTask, match="already queued"):
        q.push(task("a", 10))
    assert a.enqueued_at == 10.0 and a.work_s == COST.prefill_time(100, 0)
    assert q.load() == (2, 100 + 136, COST.prefill_time(100) + COST.prefill_time(200, 64))
    assert q.pop() is a and a.started_at == 11.0
    assert q.pop() is None  # one at a time
    clock.advance(0.25)
    work_a = max(0.0, COST.prefill_time(100) - 0.25)
    assert q.load() == (2, 236, work_a + COST.prefill_time(200, 64))
    assert "a" in q and "b" in q and "c" not in q
    q.done("a")
    assert q.load() == (1, 136, COST.prefill_time(200, 64))
    assert q.remove("b").request_id == "b" and q.remove("b") is None
    assert q.pop() is None and len(q) == 0 and q.load() == (0, 0, 0.0)


def test_remove_does_not_touch_the_running_task():
    q = PrefillQueue(COST, ManualClock(), 32)
    q.push(task("a", 10))
    q.push(task("b", 10))
    q.push(task("c", 10))
    assert q.pop().request_id == "a"
    assert q.remove("a") is None
    q.remove("b")
    q.done("a")
    assert q.pop().request_id == "c"
