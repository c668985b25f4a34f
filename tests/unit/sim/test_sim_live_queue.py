"""The simulator's prefill instance and the live prefill worker queue with the same
object (services.prefill.queue.PrefillQueue): the same placed requests, one fed through
the worker's bus handler and one through the simulator's instance, wait in the same
order and are priced and reported alike (issue 15: no second copy of the queue), at the
price the conductor booked them."""

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
from services.prefill.queue import PrefillQueue, QueuedPrefill
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


def test_the_queue_prices_a_placement_as_the_conductor_booked_it():
    """A load report that covers a dispatch replaces the conductor's booking with the
    queue's price: the two are one rule (the pull holds the instance too)."""
    from bus_schemas.load import DecodeLoad, PrefillLoad
    from services.conductor.placement_policy import Placement, PlacementPolicy, PlacementRequest

    clock = ManualClock(0.0)
    pol = PlacementPolicy(clock, COST, ttft_slo_s=1e9, tbt_slo_s=1e9)
    for inst, node, work in (("P-n0", "n0", 0.0), ("P-n9", "n9", 100.0)):  # n9 is busy
        pol.observe_prefill(
            PrefillLoad(
                instance=inst, node=node, queue_len=0, queued_tokens=0, queued_work_s=work, ts=0.0
            )
        )
    pol.observe_decode(
        DecodeLoad(
            instance="D-n1",
            node="n1",
            batch_size=0,
            waiting=0,
            max_batch=64,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )
    n = 50 * BS + 7
    p = pol.place(PlacementRequest("r", n, tuple(range(50)), BS), {"n0": 2, "n9": 40})
    assert isinstance(p, Placement) and p.prefill_instance == "P-n0"
    assert p.source is not None and (p.expected_hit_blocks, p.source.num_blocks) == (2, 38)
    booked = pol.queue_s("P-n0")  # no report yet: what the conductor dispatched to it
    assert booked == p.est_transfer_s + p.est_prefill_s and p.est_transfer_s > 0

    live: PrefillQueue[QueuedPrefill] = PrefillQueue(COST, ManualClock(0.0))
    t = task("r", n, p.expected_hit_blocks, (p.source.first_block, p.source.num_blocks))
    live.push(QueuedPrefill.of(t, BS))
    loop = EventLoop()
    link = Link(COST)
    links = {"n0": link, "n9": Link(COST)}
    sim = PrefillInstance("P-n0", "n0", loop, COST, link, links, lambda r, t: None)
    sim.push(sim_request(0, "r", n, 2, (2, 38)))
    sim.push(sim_request(1, "s", n, 2, (2, 38)))  # waits: priced, not yet running
    assert live.work_s("r") == sim.queue.work_s("s") == booked
