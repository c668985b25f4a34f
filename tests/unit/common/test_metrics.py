"""services.common.metrics: span-derived histograms, collectors, reasons, /metrics."""

from types import SimpleNamespace

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Histogram

from services.common import metrics as m
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.metric_collectors import WorkerSample
from services.conductor import metrics as conductor_metrics
from services.decode import metrics as decode_metrics
from services.engine.base import EngineStats
from services.prefill import metrics as prefill_metrics
from services.prefill.queue import PrefillQueue
from services.store import metrics as store_metrics
from services.store.pool.block_pool import BlockPool


def value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


def test_buckets_1_2_5():
    assert m.buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert m.buckets_1_2_5(4) == (1, 2)


def test_span_metrics_observe_stage_durations():
    reg = CollectorRegistry()
    h = Histogram("t_prefill_seconds", "x", buckets=(0.01, 0.1, 1.0), registry=reg)
    ops = Histogram("t_store_seconds", "x", ["op"], buckets=(0.01, 0.1, 1.0), registry=reg)
    provider = TracerProvider()
    provider.add_span_processor(
        m.SpanMetrics({"prefill.compute": (h, {}), "store.ship": (ops, {"op": "ship"})})
    )
    tr = provider.get_tracer("t")
    ms = 1_000_000
    tr.start_span("prefill.compute", start_time=0).end(end_time=40 * ms)
    tr.start_span("prefill.compute", start_time=0).end(end_time=500 * ms)
    tr.start_span("store.ship", start_time=0).end(end_time=5 * ms)
    tr.start_span("unrelated", start_time=0).end(end_time=5 * ms)
    failed = tr.start_span("prefill.compute", start_time=0)
    failed.set_status(Status(StatusCode.ERROR, "boom"))
    failed.end(end_time=7 * ms)
    assert value(reg, "t_prefill_seconds_count") == 2
    assert value(reg, "t_prefill_seconds_sum") == 0.54
    assert value(reg, "t_prefill_seconds_bucket", le="0.1") == 1
    assert value(reg, "t_store_seconds_sum", op="ship") == 0.005


def test_every_stage_span_has_a_histogram():
    for name in (
        "conductor.place",
        "prefill.queue",
        "prefill.load_prefix",
        "prefill.compute",
        "prefill.ship",
        "decode.load_kv",
        "decode.generate",
    ):
        assert name in m.SPAN_HISTOGRAMS


def test_reason_labels_are_low_cardinality():
    assert m.reason_label("predicted TTFT 3.214s exceeds the 1s SLO") == "ttft_slo"
    assert m.reason_label("predicted TBT 0.1234s exceeds the 0.1s SLO") == "tbt_slo"
    assert m.reason_label("prefill pool overloaded (load 1.37 > 1)") == "prefill_overloaded"
    assert m.reason_label("decode pool overloaded (load 2.00 > 1)") == "decode_overloaded"
    assert m.reason_label("no live decode instance") == "no_decode_instance"
    assert (
        m.reason_label("decode instance over its TBT SLO after prefill (predicted 0.2s > 0.1s)")
        == "tbt_slo_after_prefill"
    )
    assert m.reason_label("no store could take the request (prefill: capacity)") == "store"
    assert m.reason_label("Something 12 new, happened!") == "something_new_happened"
    assert m.reason_label("42") == "unknown"


def test_count_rejection():
    def get():
        return m.sample(m.REJECTIONS, service="admission", code="429", reason="ttft_slo")

    before = get()
    m.count_rejection("admission", 429, "predicted TTFT 9s exceeds the 1s SLO")
    m.count_rejection("admission", 429, "predicted TTFT 8s exceeds the 1s SLO")
    assert get() - before == 2


def _prefill_worker():
    q = PrefillQueue(CostModel(), ManualClock())
    return SimpleNamespace(
        queue=q,
        counters={
            "tasks_done": 3,
            "computed_tokens": 700,
            "prefix_tokens_loaded": 300,
            "remote_tokens_pulled": 64,
        },
    )


def _decode_worker(batch=5, waiting=2, loading=1):
    engine = SimpleNamespace(
        stats=lambda: EngineStats(
            batch_size=batch, waiting=waiting, kv_tokens=1234, step_time_s=0.02
        )
    )
    return SimpleNamespace(
        engine=engine, _loading=loading, counters={"tokens_generated": 99, "tasks_done": 4}
    )


def test_worker_collector_prefill_and_decode():
    reg = CollectorRegistry()
    workers = {"prefill": lambda: prefill_metrics.sample(_prefill_worker())}
    reg.register(m.worker_collector(workers))
    assert value(reg, "perigee:num_requests_waiting") == 0
    assert value(reg, "perigee:num_requests_running") == 0
    assert value(reg, "perigee:prefix_cache_queries_total") == 1000
    assert value(reg, "perigee:prefix_cache_hits_total") == 300
    assert value(reg, "perigee:prefix_cache_remote_hits_total") == 64
    assert value(reg, "perigee:prefill_tasks_done_total") == 3
    workers["decode"] = lambda: decode_metrics.sample(_decode_worker())
    # a switchable instance mid-switch: both roles add up
    assert value(reg, "perigee:num_requests_running") == 5
    assert value(reg, "perigee:num_requests_waiting") == 3
    assert value(reg, "perigee:decode_kv_tokens") == 1234
    assert value(reg, "perigee:decode_tokens_generated_total") == 99
    del workers["prefill"]
    assert value(reg, "perigee:prefix_cache_hits_total") is None


def test_track_worker():
    w, other = object(), object()
    m.track_worker("decode", w, lambda: WorkerSample(0, 0, []))
    m.untrack_worker("decode", other)
    assert m.WORKERS["decode"][0] is w
    m.untrack_worker("decode", w)
    assert "decode" not in m.WORKERS


def test_store_collector_bytes_per_tier_and_transfers():
    pool = BlockPool(10, 32, ManualClock())
    svc = SimpleNamespace(
        pool=pool,
        block_bytes=1000,
        data=SimpleNamespace(
            counters={
                "bytes_in": 4096,
                "bytes_out": 8192,
                "transfer_errors": 2,
                "bad_frames": 1,
                "ships": 3,
                "pulls": 1,
                "writes_in": 5,
                "reads_in": 0,
                "local_copies": 0,
                "blocks_written_remote": 7,
                "blocks_read_remote": 0,
                "new_counter": 9,
                "tcp_bytes": 4096,
                "shm_bytes": 8192,
                "rdma_bytes": 0,
            }
        ),
    )
    reg = CollectorRegistry()
    reg.register(store_metrics.store_collector(svc))
    assert value(reg, "perigee:store_bytes", tier="dram") == 0
    assert value(reg, "perigee:store_capacity_bytes", tier="dram") == 10_000
    assert value(reg, "perigee:store_blocks", state="free") == 10
    assert value(reg, "perigee:transfer_bytes_total", direction="in") == 4096
    assert value(reg, "perigee:transfer_bytes_total", direction="out") == 8192
    assert value(reg, "perigee:kv_transfer_bytes_total", transport="tcp") == 4096
    assert value(reg, "perigee:kv_transfer_bytes_total", transport="shm") == 8192
    assert value(reg, "perigee:kv_transfer_bytes_total", transport="rdma") == 0
    assert value(reg, "perigee:transfer_errors_total", kind="transfer") == 2
    assert value(reg, "perigee:transfer_errors_total", kind="bad_frame") == 1
    assert value(reg, "perigee:transfer_requests_total", op="ship") == 3
    assert value(reg, "perigee:store_data_new_counter_total") == 9
    assert value(reg, "perigee:store_evictions_total") == 0
    assert value(reg, "perigee:store_open_txs") == 0
    svc.tier_stats = lambda: {"dram": (2500, 10_000), "ssd": (1 << 20, 1 << 30)}
    assert value(reg, "perigee:store_bytes", tier="ssd") == 1 << 20
    assert value(reg, "perigee:kv_cache_usage_perc") == 0.25


def test_store_tiers_from_tiered_pool_stats():
    stats = {
        "capacity_blocks": 100,
        "used_blocks": 10,
        "ssd_capacity_blocks": 1000,
        "ssd_blocks": 40,
        "ssd_pinned_blocks": 2,
        "vram_capacity_blocks": 8,
        "vram_blocks": 8,
    }
    assert store_metrics.store_tiers(stats, 2) == {
        "dram": (20, 200),
        "ssd": (80, 2000),
        "vram": (16, 16),
    }


def test_conductor_collector():
    svc = SimpleNamespace(
        pending={"a": 1, "b": 2}, policy=SimpleNamespace(stats={"placed": 7, "pulls": 2})
    )
    reg = CollectorRegistry()
    reg.register(conductor_metrics.conductor_collector(svc))
    assert value(reg, "perigee:conductor_pending_requests") == 2
    assert value(reg, "perigee:conductor_placed_total") == 7
    assert value(reg, "perigee:conductor_pulls_total") == 2


async def test_serve_metrics_exposes_the_registry():
    m.setup("admission", span_metrics=False)
    m.setup("admission", span_metrics=False)  # idempotent
    server = await m.serve_metrics("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
    finally:
        await server.close()
    assert "# TYPE perigee:requests_admitted_total counter" in text
    assert "# TYPE perigee:requests_rejected_total counter" in text
    assert "process_cpu_seconds_total" in text and "python_info" in text


async def test_health_and_ready_beside_metrics():
    """/health answers while the loop does; /ready follows the service's own test, which
    it may change later (a worker: once it takes tasks; not while it drains)."""
    serving = False
    server = await m.serve_metrics("127.0.0.1", 0, ready=lambda: serving)
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as s:

            async def status(path: str) -> int:
                async with s.get(base + path) as r:
                    return r.status

            assert (await status("/health"), await status("/ready")) == (200, 503)
            serving = True
            assert await status("/ready") == 200
            server.ready = lambda: False  # replaced once the service knows more
            assert (await status("/health"), await status("/ready")) == (200, 503)
    finally:
        await server.close()
    plain = await m.serve_metrics("127.0.0.1", 0)  # no test given: ready once serving
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{plain.port}/ready") as r:
                assert r.status == 200
    finally:
        await plain.close()


def test_add_arguments_default_off():
    import argparse

    p = argparse.ArgumentParser()
    m.add_arguments(p)
    a = p.parse_args([])
    assert (a.metrics_port, a.metrics_host) == (0, "127.0.0.1")
    assert p.parse_args(["--metrics-port", "9400"]).metrics_port == 9400
