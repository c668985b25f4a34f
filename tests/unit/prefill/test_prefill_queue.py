from dataclasses import dataclass

import pytest

from bus_schemas.placement import PrefillTask, PrefixSource
from bus_schemas.requests import GenerateRequest
from services.common import reservation as plan
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.errors import BadTask
from services.prefill.queue import (
    PrefillQueue,
    QueuedPrefill,
    chunked_prefill_time,
    prefix_tokens,
)

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


def queued(t: PrefillTask) -> QueuedPrefill:
    return QueuedPrefill.of(t, 32)


def test_a_task_is_queued_with_the_prefix_and_pull_the_conductor_expects():
    item = queued(task("a", 100, hit=1, remote=(1, 2)))
    assert (item.request_id, item.prompt_tokens, item.prefix_tokens, item.pulled_tokens) == (
        "a",
        100,
        96,
        64,
    )
    assert (
        queued(task("a", 100, hit=2, remote=(0, 1))).pulled_tokens,
        queued(task("a", 100)).pulled_tokens,
    ) == (0, 0)
    with pytest.raises(BadTask, match="remote prefix starts at block 2"):
        queued(task("a", 100, hit=1, remote=(2, 1)))


def test_fifo_one_running_and_load_accounting():
    clock = ManualClock(10.0)
    q = PrefillQueue(COST, clock)
    a = queued(task("a", 100))
    q.push(a)
    clock.advance(1.0)
    q.push(queued(task("b", 200, hit=2)))
    with pytest.raises(BadTask, match="already queued"):
        q.push(queued(task("a", 10)))
    assert q.work_s("a") == COST.prefill_time(100, 0)
    assert q.load() == (2, 100 + 136, COST.prefill_time(100) + COST.prefill_time(200, 64))
    assert q.pop() is a and q.running is a and q.running_ends_at() == 11.0 + q.work_s("a")
    assert q.pop() is None  # one at a time
    clock.advance(0.25)
    work_a = max(0.0, COST.prefill_time(100) - 0.25)
    assert q.load() == (2, 236, pytest.approx(work_a + COST.prefill_time(200, 64)))
    assert "a" in q and "b" in q and "c" not in q
    q.done("a")
    assert q.load() == (1, 136, COST.prefill_time(200, 64))
    assert q.remove("b").request_id == "b" and q.remove("b") is None
    assert q.pop() is None and len(q) == 0 and q.load() == (0, 0, 0.0)


def test_a_pull_is_priced_with_the_compute_and_the_last_token_always_computed():
    q = PrefillQueue(COST, ManualClock())
    q.push(queued(task("pull", 100, hit=1, remote=(1, 2))))  # 64 tokens pulled, 96 cached
    q.push(queued(task("full", 96, hit=3)))  # every block cached: the last token computed
    assert q.work_s("pull") == COST.prefill_time(100, 96) + COST.transfer_time(64)
    assert q.work_s("full") == COST.prefill_time(96, 95) > 0
    assert q.load()[1] == 4 + 1


def test_chunks_are_priced_one_by_one():
    q = PrefillQueue(COST, ManualClock(), chunk_tokens=4096)
    q.push(queued(task("a", 10_000, hit=1)))
    chunks = [(32, 4128), (4128, 8224), (8224, 10_000)]
    assert q.work_s("a") == sum(COST.prefill_time(b, a) for a, b in chunks)
    assert q.work_s("a") == chunked_prefill_time(COST, 10_000, 32, 4096)


def test_the_reservation_reprices_the_running_task_from_its_compute_start():
    clock = ManualClock()
    q = PrefillQueue(COST, clock)
    item = queued(task("a", 1000, hit=1, remote=(1, 10)))
    q.push(item)
    q.pop()
    clock.advance(2.0)  # the reservation took 2 s and the holder had lost the prefix
    item.settle(plan.grant(item.task.source, prefill_hit=1, source_granted=False), 32)
    q.reprice_running()
    assert (item.prefix_tokens, item.pulled_tokens) == (32, 0)
    assert q.load() == (1, 968, pytest.approx(COST.prefill_time(1000, 32)))
    q.runs_until(3.0)  # an adapter that knows when it ends (the simulator)
    assert q.load() == (1, 968, 1.0) and q.running_ends_at() == 3.0


def test_reprice_takes_the_new_cost_for_queued_and_running_work():
    clock = ManualClock()
    q = PrefillQueue(COST, clock)
    q.push(queued(task("a", 1000)))
    q.push(queued(task("b", 2000)))
    q.pop()
    clock.advance(0.01)
    slow = COST.with_speedup(0.5)
    q.reprice(slow)
    assert q.work_s("b") == slow.prefill_time(2000)
    assert q.load()[2] == pytest.approx(slow.prefill_time(2000) + slow.prefill_time(1000) - 0.01)


@dataclass
class Stage:
    """A pipeline stage as the simulator queues one (perigee.sim.pipeline_gang.StageTask's shape)."""

    request_id: str
    prompt_tokens: int
    prefix_tokens: int
    stage_work_s: float | None
    pulled_tokens: int = 0


def test_a_pipeline_stage_is_priced_at_its_booked_share():
    q: PrefillQueue[Stage | QueuedPrefill] = PrefillQueue(COST, ManualClock())
    q.push(Stage("r/s1", 100_000, 30_000, stage_work_s=7.5))
    q.push(queued(task("a", 100)))
    assert q.work_s("r/s1") == 7.5 and q.work_s("a") == COST.prefill_time(100)
    assert q.load() == (2, 70_000 + 100, 7.5 + COST.prefill_time(100))


def test_remove_does_not_touch_the_running_task():
    q = PrefillQueue(COST, ManualClock())
    for rid in "abc":
        q.push(queued(task(rid, 10)))
    assert q.pop().request_id == "a"
    assert q.remove("a") is None
    q.remove("b")
    q.done("a")
    assert q.pop().request_id == "c"
