"""The simulator and the conductor service, fed the same requests, the same KV events and
the same load reports, make the same placements (issue 26 item 1): both run
services.conductor.placement_round.

The simulator runs a trace on its own; a ConductorService (bus faked: it records what
it publishes) is its twin: every load report, prefill_done and release the simulator's
policy gets, the conductor's gets too; every KV batch the simulated stores publish goes
to the conductor's shadow index; before each placement the simulator makes, the same
request goes through ``ConductorService.schedule``, and the PrefillTask (or Error) it
publishes must carry what the simulator placed."""

import asyncio
import random

from bus_schemas.codec import decode
from bus_schemas.placement import PrefillTask
from bus_schemas.requests import Error, GenerateRequest
from perigee.sim.simulator import SimConfig, Simulator
from perigee.trace import TraceRequest
from services.conductor import placement_round
from services.conductor.service import ConductorConfig, ConductorService


class RecordingNats:
    """What ConductorService needs of a NATS client: publish (recorded)."""

    max_payload = 64 << 20

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def jetstream(self):
        return None

    async def publish(self, subject, data, reply="", headers=None) -> None:
        self.sent.append((subject, data))


def _trace(n: int, seed: int) -> list[TraceRequest]:
    """Bursty arrivals over a few shared conversations, so queues, prefix hits, pulls
    and rejections all happen."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(6.0)
        conv = rng.randrange(6)
        blocks = rng.randrange(1, 40)
        shared = rng.randrange(blocks + 1)
        hashes = tuple(conv * 1000 + b for b in range(shared)) + tuple(
            10**6 + rng.randrange(10**6) for _ in range(blocks - shared)
        )
        out.append(
            TraceRequest(t, blocks * 512 + rng.randrange(512), rng.randrange(1, 200), hashes)
        )
    return out


class Twin:
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.nc = RecordingNats()
        cfg = sim.cfg
        self.conductor = ConductorService(
            self.nc,  # type: ignore[arg-type]
            ConductorConfig(
                block_size=cfg.block_size,
                ttft_slo_s=cfg.ttft_slo_s,
                tbt_slo_s=cfg.tbt_slo_s,
                balancing_threshold=cfg.balancing_threshold,
                strategy=cfg.policy,
                report_grace_s=0.0,
                ttft_feedback=False,
                ttft_margin=1.0,
                serve_when_idle=False,
                reserve_retries=False,  # the simulator's clients never come back
                durable_intake=False,
            ),
            clock=sim.loop.clock,
            cost=cfg.cost,
        )
        self.loop = asyncio.new_event_loop()
        self.compared = self.placed = self.rejected = 0
        self.placing = False
        self._mirror()

    def _mirror(self) -> None:
        sim, mine = self.sim, self.conductor.policy
        theirs = sim.placement
        for name in ("observe_prefill", "observe_decode", "prefill_done", "release"):
            original, twin = getattr(theirs, name), getattr(mine, name)

            def both(*a, _o=original, _t=twin, **k):
                if not self.placing:  # place() itself releases a retry: the twin did too
                    _t(*a, **k)
                return _o(*a, **k)

            setattr(theirs, name, both)
        index, shadow = sim.cluster.index, self.conductor.shadow
        apply = index.apply

        def apply_both(batch):
            shadow.index.apply(batch)
            return apply(batch)

        index.apply = apply_both  # type: ignore[method-assign]
        place, dispatch = sim._place, sim._dispatch
        self.sim_task: placement_round.TaskFields | None = None

        def sim_dispatch(req, task):
            self.sim_task = task
            return dispatch(req, task)

        def place_both(req):
            for node in sim.cluster.nodes:  # every store announced, alive
                shadow.stores.seen(node)
            self.nc.sent.clear()
            greq = GenerateRequest(
                request_id=req.rid,
                prompt_token_ids=[7] * req.num_tokens,
                block_size=sim.cfg.block_size,
                block_hashes=list(req.hashes),
                arrival_ts=req.arrival,
            )
            self.loop.run_until_complete(self.conductor.schedule(greq, reply="client.r"))
            self.sim_task = None
            self.placing = True
            try:
                place(req)
            finally:
                self.placing = False
            self._compare(req)

        sim._place = place_both  # type: ignore[method-assign]
        sim._dispatch = sim_dispatch  # type: ignore[method-assign]

    def _compare(self, req) -> None:
        sent = dict(self.nc.sent)
        self.compared += 1
        if self.sim_task is None:  # the simulator's conductor rejected it
            assert req.reject_stage == "conductor"
            err = decode(sent["client.r"], Error)
            assert err.message == req.reject_reason
            self.rejected += 1
            return
        f = self.sim_task
        task = decode(sent[f"perigee.prefill.{f.prefill_instance}.tasks"], PrefillTask)
        live = placement_round.TaskFields(
            prefill_instance=task.prefill_instance,
            prefill_node=task.prefill_node,
            decode_instance=task.decode_instance,
            decode_node=task.decode_node,
            expected_hit_blocks=task.expected_hit_blocks,
            source=task.source,
            est_ttft_s=task.est_ttft_s,
            cpp_stages=tuple(task.cpp_stages),
            cpp_chunk_tokens=task.cpp_chunk_tokens,
            prefill_incarnation=task.prefill_incarnation,
            decode_incarnation=task.decode_incarnation,
        )
        assert live == f, req.rid
        self.placed += 1


def test_simulator_and_conductor_place_alike():
    trace = _trace(400, seed=3)
    sim = Simulator(
        trace,
        SimConfig(
            prefill=3,
            decode=2,
            cache_tokens_per_node=60_000,
            ttft_slo_s=3.0,
            sample_interval_s=0.0,
        ),
    )
    twin = Twin(sim)
    sim.run()
    twin.loop.close()
    assert twin.compared == sum(1 for r in sim.requests if r.reject_stage != "admission")
    # The run exercised both outcomes and the cache: hits and at least one pull.
    assert twin.placed > 50 and twin.rejected > 0
    assert sim.placement.stats["pulls"] > 0
    assert any(r.cached_tokens for r in sim.requests)
