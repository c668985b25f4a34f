"""perigee breakdown on hand-built span files: exact stage durations."""

import json

from perigee import breakdown as bd
from perigee.cli import main as cli_main

MS = 1_000_000  # ns


def span(trace, name, start_ms, end_ms, service="svc", attrs=None, events=None, parent=None):
    out = {
        "name": name,
        "trace_id": trace,
        "span_id": f"{hash((trace, name)) & (2**64 - 1):016x}",
        "parent_id": parent,
        "service": service,
        "start_ns": start_ms * MS,
        "end_ns": end_ms * MS,
        "kind": "INTERNAL",
        "attributes": attrs or {},
        "status": "UNSET",
    }
    if events:
        out["events"] = events
    return out


def request_trace(
    trace, t0, *, prompt=1000, cached=0, pull=None, first_token_event=True, ttft_ms=None
):
    """A request starting at t0 ms with fixed stage lengths:
    queue 7 (admission/conductor/queue), [pull], compute 40, transfer 3, load 2, first 1,
    decode 50."""
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.response.id": f"cmpl-{trace}",
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": 16,
        "perigee.cached_tokens": cached,
        "http.response.status_code": 200,
    }
    p = 0 if pull is None else pull
    t_compute = t0 + 7 + p
    t_ft = t_compute + 40 + 3 + 2 + 1
    if ttft_ms is not None:
        attrs["perigee.ttft_s"] = ttft_ms / 1e3
    events = (
        [{"name": "first_token", "ts_ns": t_ft * MS, "attributes": {}}]
        if first_token_event
        else None
    )
    spans = [
        span(trace, "gateway.request", t0, t_ft + 50, "gateway", attrs, events),
        span(trace, "admission.request", t0 + 1, t0 + 2, "admission"),
        span(trace, "conductor.schedule", t0 + 2, t0 + 5, "conductor"),
        span(trace, "conductor.place", t0 + 2, t0 + 5, "conductor"),
        span(trace, "prefill.queue", t0 + 5, t0 + 7, "prefill-0"),
        span(trace, "prefill.compute", t_compute, t_compute + 40, "prefill-0"),
        span(trace, "prefill.ship", t_compute + 5, t_compute + 43, "prefill-0"),
        span(trace, "store.ship", t_compute + 5, t_compute + 42, "store-p0"),
        span(trace, "store.write", t_compute + 6, t_compute + 42, "store-d0"),
        span(trace, "decode.load_kv", t_compute + 43, t_compute + 45, "decode-0"),
        span(trace, "decode.first_token", t_compute + 45, t_compute + 46, "decode-0"),
        span(trace, "decode.generate", t_compute + 46, t_ft + 49, "decode-0"),
    ]
    if pull is not None:
        spans.append(span(trace, "prefill.load_prefix", t0 + 7, t0 + 7 + pull, "prefill-0"))
    return spans


def write(path, spans, junk=()):
    with open(path, "w") as f:
        for line in junk:
            f.write(line + "\n")
        for s in spans:
            f.write(json.dumps(s) + "\n")


def stages(**ms):
    return {s: ms.get(s, 0) * MS for s in bd.STAGES}


def test_exact_stages_from_hand_built_trace(tmp_path):
    f = tmp_path / "spans.jsonl"
    write(
        f,
        request_trace("a" * 32, 1000) + request_trace("b" * 32, 2000, cached=960, pull=4),
        junk=["not json", '{"unrelated": 1}', ""],
    )
    reqs = bd.requests_from(bd.read_spans(f))
    assert [r.request_id for r in reqs] == ["cmpl-" + "a" * 32, "cmpl-" + "b" * 32]
    a, b = reqs
    assert a.stages_ns == stages(
        queue=7, prefill_compute=40, transfer=3, decode_load=2, first_token=1, decode=50
    )
    assert b.stages_ns == stages(
        queue=7,
        prefix_load=4,
        prefill_compute=40,
        transfer=3,
        decode_load=2,
        first_token=1,
        decode=50,
    )
    assert (a.ttft_ns, a.e2e_ns, a.kv_ship_ns) == (53 * MS, 103 * MS, 38 * MS)
    assert (b.ttft_ns, b.e2e_ns) == (57 * MS, 107 * MS)
    assert b.hit == 0.96 and a.hit == 0.0
    assert a.services == [
        "admission",
        "conductor",
        "decode-0",
        "gateway",
        "prefill-0",
        "store-d0",
        "store-p0",
    ]


def test_ttft_attribute_when_no_event_and_monotonic_boundaries(tmp_path):
    spans = request_trace("c" * 32, 0, first_token_event=False, ttft_ms=60)
    # decode.load_kv starts "before" compute ended (clock skew between hosts): transfer
    # becomes 0 and the load is measured from the compute end.
    for s in spans:
        if s["name"] == "decode.load_kv":
            s["start_ns"], s["end_ns"] = 45 * MS, 49 * MS
    [r] = bd.requests_from(spans)
    assert r.stages_ns == stages(
        queue=7, prefill_compute=40, transfer=0, decode_load=2, first_token=11, decode=43
    )
    assert r.e2e_ns == 103 * MS


def test_incomplete_traces_are_skipped():
    rejected = [
        span("d" * 32, "gateway.request", 0, 5, attrs={"http.response.status_code": 429}),
        span("d" * 32, "admission.request", 1, 2),
    ]
    load_report = [span("e" * 32, "conductor.load", 0, 1)]
    assert bd.requests_from(rejected + load_report) == []


def test_groups_by_length_and_prefix_hit():
    reqs = []
    for i, (prompt, cached) in enumerate(
        [(1000, 0), (900, 0), (1000, 960), (3000, 0), (1000, 200)]
    ):
        reqs += bd.requests_from(request_trace(f"{i:032x}", i * 1000, prompt=prompt, cached=cached))
    g = bd.groups(reqs, high=0.5)
    assert [(x["prompt_tokens_upto"], x["prefix_hit"], x["requests"]) for x in g] == [
        (1024, "0%", 2),
        (1024, "partial", 1),
        (1024, ">=50%", 1),
        (4096, "0%", 1),
    ]
    assert g[0]["stages_s"]["prefill_compute"] == 0.04
    assert g[0]["e2e_s"] == 0.103 and g[0]["ttft_s"] == 0.053


def test_cli_prints_writes_json_and_png(tmp_path, capsys):
    f = tmp_path / "spans.jsonl"
    write(f, request_trace("a" * 32, 0) + request_trace("b" * 32, 500, cached=960, pull=4))
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert cli_main(["breakdown", str(f), "--json", str(out_json), "--png", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "2 requests" in text and "cmpl-" in text and "<=1024 >=50%" in text
    data = json.loads(out_json.read_text())
    assert data["stages"] == list(bd.STAGES)
    assert data["requests"][1]["stages_s"]["prefix_load"] == 0.004
    assert [g["prefix_hit"] for g in data["groups"]] == ["0%", ">=50%"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_with_no_request_fails(tmp_path):
    f = tmp_path / "spans.jsonl"
    write(f, [span("e" * 32, "conductor.load", 0, 1)])
    assert bd.main([str(f)]) == 1


def test_first_token_streamed_by_prefill_ends_ttft_before_the_handoff(tmp_path):
    # The first token reaches the gateway 1 ms after compute, 2 ms before decode loads.
    spans = request_trace("c" * 32, 1000, first_token_event=False)
    root = spans[0]
    root["events"] = [{"name": "first_token", "ts_ns": (1000 + 7 + 40 + 1) * MS, "attributes": {}}]
    f = tmp_path / "spans.jsonl"
    write(f, spans)
    [r] = bd.requests_from(bd.read_spans(f))
    assert r.ttft_ns == 48 * MS
    assert r.stages_ns == stages(
        queue=7, prefill_compute=40, first_token=1, transfer=2, decode_load=2, decode=51
    )
    assert r.e2e_ns == 103 * MS
