"""The simulator's prefill instance and the live prefill worker queue with the same
object (services.prefill.queue.PrefillQueue): the same placed requests, one fed through
the worker's bus handler and one through the simulator's instance, wait in the same
order and are priced and reported alike (issue 15: no second copy of the queue)."""

from bus_schemas.placement import PrefillTask, PrefixSource
from bus_schemas.requests import CancelRequest, GenerateRequest
from perigee.sim.cluster import Link
from perigee.sim.events import EventLoop
from perigee.sim.instances import PrefillInstance
from perigee.sim.request import SimRequest
from services.common import reservation as plan
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.prefill.queue import PrefillQueue
from services.prefill.worker import PrefillWorker

BS = 32
COST = CostModel()
# (request id, prompt tokens, local hit blocks, remote prefix (first, count) or None)
PLACED = [
    ("a", 1000, 0, None),
    ("b", 2000, 2, None),
    ("c", 3000, 1, (1, 40)),  # 40 blocks pulled from n9 before compute
    ("d", 640, 20, None),  # every block cached: the last token is still computed
]


def task(rid: str, n: int, hit: int, remote: tuple[int, int] | None) -> PrefillTask:
    src = PrefixSource(node="n9", first_block=remote[0], num_blocks=remote[1]) if remote else None
    return PrefillTask(
        request=GenerateRequest(request_id=rid, prompt_token_ids=[7] * n),
        conductor_id="c0",
        prefill_instance="P-n0",
        decode_instance="D-n1",
        prefill_node="n0",
        decode_node="n1",
        expected_hit_blocks=hit,
        source=src,
    )


def sim_request(i: int, rid: str, n: int, hit: int, remote: tuple[int, int] | None) -> SimRequest:
    """As perigee.sim.simulator's _dispatch hands a placement to its prefill instance."""
    src = PrefixSource(node="n9", first_block=remote[0], num_blocks=remote[1]) if remote else None
    req = SimRequest(rid=rid, index=i, arrival=0.0, num_tokens=n, output_tokens=1, hashes=[])
    g = plan.grant(src, prefill_hit=hit, source_granted=True)
    req.cached_tokens, req.pulled_tokens = g.prefix_tokens(n, BS), g.pulled_tokens(n, BS)
    req.pull_source = "n9" if g.pull else ""
    return req


class HoldReservation:
    """A reserver the test never lets answer: the running task stays running."""

    async def close(self) -> None:
        pass


async def test_the_simulator_and_the_live_worker_queue_and_price_alike():
    clock = ManualClock(0.0)
    worker = PrefillWorker(
        None,  # type: ignore[arg-type] - no bus: the handler is called directly
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        instance="P-n0",
        node="n0",
        layout=KVLayout(ModelSpec.from_dir(), BS),
        cost=COST,
        clock=clock,
        unix_clock=clock,
        reserver=HoldReservation(),  # type: ignore[arg-type]
    )
    loop = EventLoop()
    link = Link(COST)
    sim = PrefillInstance(
        "P-n0",
        "n0",
        loop,
        COST,
        link,
        {"n0": link, "n9": Link(COST)},
        lambda r, t: None,
        reserve=lambda req, inst: None,  # holds its reservation: stays running
    )
    assert type(worker.queue) is type(sim.queue) is PrefillQueue

    for i, placed in enumerate(PLACED):
        await worker._on_task(task(*placed), None)  # type: ignore[arg-type]
        sim.push(sim_request(i, *placed))  # an idle instance starts it at once
        if i == 0:  # so does the live runner when the task wakes it (not started here)
            assert worker.queue.pop() is not None

    def state(q: PrefillQueue) -> tuple:
        r = q.running
        return (
            r.request_id if r else None,
            [i.request_id for i in q.waiting],
            {rid: q.work_s(rid) for rid, *_ in PLACED if rid in q},
            q.load(),
        )

    live, simulated = state(worker.queue), state(sim.queue)
    assert live == simulated
    assert live[:2] == ("a", ["b", "c", "d"])
    # One pricing rule: the pull's transfer is part of the work it holds the instance for.
    assert live[2]["c"] == COST.prefill_time(3000, 41 * BS) + COST.transfer_time(40 * BS)
    assert live[2]["d"] == COST.prefill_time(640, 639)
    report = worker.load_report()
    assert (report.queue_len, report.queued_tokens, report.queued_work_s) == (
        4,
        1000 + (2000 - 64) + (3000 - 41 * BS) + 1,
        sum(live[2].values()),
    )
    sl = sim.load(loop.now())
    assert (sl.queue_len, sl.queued_tokens, sl.queued_work_s) == (
        report.queue_len,
        report.queued_tokens,
        report.queued_work_s,
    )

    # Time passes for the running task; a cancelled one leaves both queues alike.
    clock.advance(0.01)
    loop.clock.advance(0.01)
    failed: list[tuple[str, str]] = []

    async def report_failure(req: GenerateRequest, *args: object) -> None:
        failed.append((req.request_id, str(args[4])))

    worker._report_failure = report_failure  # type: ignore[method-assign]
    await worker._on_cancel(CancelRequest(request_id="c", reason="client gone"), None)  # type: ignore[arg-type]
    sim.queue.remove("c")
    assert failed == [("c", "cancelled: client gone")]
    assert state(worker.queue) == state(sim.queue)
    assert state(sim.queue)[1] == ["b", "d"] and sim.queue.load()[2] > 0
