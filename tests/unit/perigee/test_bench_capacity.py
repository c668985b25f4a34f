"""perigee bench capacity's arithmetic and its client, against a stand-in HTTP server:
a step held or not, the highest held rate, the outcome of each request."""

import argparse
import asyncio

import pytest
from aiohttp import web

from perigee.bench import bus_baseline
from perigee.bench.capacity import (
    Step,
    gate_env,
    held_rate,
    in_rtts,
    parse_layouts,
    parse_rates,
    step,
)
from tests.unit.perigee.test_lean_http import aiohttp_server


def test_a_step_holds_without_errors_and_under_the_p99():
    s = Step(100.0, 4, ok=4, overhead_s=[0.01, 0.01, 0.02, 0.04])
    assert s.held(50.0) and not s.held(30.0)
    shed = Step(100.0, 4, ok=3, rejected=1, overhead_s=[0.01] * 3)
    assert shed.answered(50.0)  # 429s are answers ...
    assert not shed.held(50.0)  # ... but a rate that needs them is not held
    assert shed.held(50.0, max_429_share=0.25)
    assert not Step(100.0, 4, ok=3, errors={"500": 1}, overhead_s=[0.01] * 3).answered(50.0)
    assert not Step(100.0, 4, rejected=4).answered(50.0)  # nothing served: nothing to hold


def test_the_held_rate_is_the_last_of_the_leading_held_steps():
    good = [Step(r, 1, ok=1, overhead_s=[0.01]) for r in (25, 50, 100)]
    slow = Step(200, 1, ok=1, overhead_s=[0.2])
    late = Step(400, 1, ok=1, overhead_s=[0.01])
    assert held_rate([*good, slow, late], 50.0) == 100
    assert held_rate([slow, *good], 50.0) == 0.0
    assert held_rate([], 50.0) == 0.0
    shedding = Step(200, 100, ok=50, rejected=50, overhead_s=[0.01] * 50)
    assert held_rate([*good, shedding], 50.0) == 100


def test_the_gates_are_the_gateways_own_unless_set():
    def env(lateness, overhead):
        return gate_env(argparse.Namespace(max_lateness_ms=lateness, max_overhead_ms=overhead))

    assert env(0.0, None) == {}  # the gateways' defaults: the overhead gate on
    assert env(0.0, 0.0) == {"PERIGEE_MAX_OVERHEAD_MS": "0"}  # off
    assert env(20.0, 35.0) == {"PERIGEE_MAX_LATENESS_MS": "20", "PERIGEE_MAX_OVERHEAD_MS": "35"}


def test_layouts_and_rates_are_checked():
    assert parse_layouts("1x1, 2x2") == [(1, 1), (2, 2)]
    assert parse_rates("25,50,400") == [25.0, 50.0, 400.0]
    for bad in ("2", "0x1", "ax1", "1x"):
        with pytest.raises(ValueError):
            parse_layouts(bad)
    for bad in ("50,25", "0,10", "fast", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)


async def _serve_and_step(rate: float, seconds: float) -> Step:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        i = int(body["prompt"].split()[-1])
        if i % 3 == 1:
            return web.json_response({"error": "busy"}, status=429)
        if i % 3 == 2:
            return web.json_response({"error": "broken"}, status=500)
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await r.write(b"data: [DONE]\n\n")
        return r

    runner, url = await aiohttp_server(completions)
    try:
        return await step(url, rate, seconds)
    finally:
        await runner.cleanup()


def test_a_step_counts_each_outcome():
    s = asyncio.run(_serve_and_step(60.0, 0.1))  # 6 requests, ids 0..5
    assert (s.sent, s.ok, s.rejected, s.errors) == (6, 2, 2, {"500": 2})
    assert len(s.overhead_s) == 2 and all(t > 0 for t in s.overhead_s)
    assert not s.held(1e9)


def test_the_stack_runs_as_many_admissions_as_asked():
    from perigee.stack import Stack, StackConfig

    def admissions(n: int) -> list[str]:
        plan = Stack(StackConfig(admissions=n, conductors=2)).plan()
        return [c.name for c in plan if c.argv[0] == "services.admission"]

    assert admissions(1) == ["admission"]
    assert admissions(2) == ["admission-0", "admission-1"]


def test_cpu_time_is_read_per_process_and_shared_per_request():
    import os

    from perigee.bench.capacity import cpu_seconds

    t0 = cpu_seconds(os.getpid())
    x = 0
    while cpu_seconds(os.getpid()) - t0 < 0.05:  # CPU work, not a timer: the count moves
        x += sum(range(1000))
    assert cpu_seconds(os.getpid()) > t0 and x > 0
    assert cpu_seconds(2**22 + 12345) == 0.0  # no such process
    s = Step(100.0, 4, ok=4, cpu_s={"gateway": 0.008, "nats-server": 0.002})
    assert s.cpu_per_request() == {"gateway": 2.0, "nats-server": 0.5, "total": 2.5}
    assert s.report()["cpu_ms_per_request"]["total"] == 2.5
    assert Step(100.0, 4).cpu_per_request() == {}


def test_wake_ups_are_counted_per_process_and_shared_per_request():
    import os
    import time

    from perigee.bench.stats import wakeups

    w0 = wakeups(os.getpid())
    for _ in range(5):  # what is counted: the thread blocks in the kernel, then wakes
        time.sleep(0.001)
    assert wakeups(os.getpid()) >= w0 + 5
    assert wakeups(2**22 + 12345) == 0  # no such process
    s = Step(100.0, 4, ok=4, wakes={"gateway": 18, "store-p0": 6})
    assert s.wakes_per_request() == {"gateway": 4.5, "store-p0": 1.5, "total": 6.0}
    assert s.report()["wakes_per_request"]["total"] == 6.0
    assert Step(100.0, 4).wakes_per_request() == {}


def test_a_requests_subjects_fold_into_kinds_and_steps_read_in_round_trips():
    gw = "perigee.gw.d2e2f975f281.cmpl-ab12.ZiElaY9OGl9zdwUj"
    assert bus_baseline.subject_kind(gw) == "perigee.gw.d2e2f975f281.<request>"
    assert bus_baseline.subject_kind("_INBOX.x7.y") == "_INBOX (replies)"
    ack = "$JS.ACK.PERIGEE_INTAKE.admission.1.2.3.4.5"
    assert bus_baseline.subject_kind(ack) == "$JS.ACK.PERIGEE_INTAKE.admission (acks)"
    claim = "perigee.conductor.placed." + "0f" * 16
    assert bus_baseline.subject_kind(claim) == "perigee.conductor.placed.<claim>"
    assert bus_baseline.subject_kind("perigee.intake") == "perigee.intake"
    ahead = "perigee.prefill.prefill-0.reserved.ba070e28c0ed4f81.decode"
    assert bus_baseline.subject_kind(ahead) == "perigee.prefill.prefill-0.reserved.<key>.decode"
    s = Step(50.0, 2, ok=2, overhead_s=[0.008, 0.016])
    o = s.report()["overhead_ms"]
    assert in_rtts(s.report(), 0.8) == f"{o['p50'] / 0.8:.1f} / {o['p99'] / 0.8:.1f}"
    assert in_rtts(s.report(), 0.0) == "-"
    assert in_rtts(Step(50.0, 1, rejected=1).report(), 0.8) == "-"


async def test_the_paced_round_trip_runs_against_a_responder_of_its_own(nats_url):
    out = await bus_baseline.paced_round_trip(nats_url, None, rate=200.0, n=10)
    assert out["round_trips"] == 10 and out["latency_ms"]["p50"] > 0
    assert set(out["cpu_us"]) == {"requester", "responder", "total"}
