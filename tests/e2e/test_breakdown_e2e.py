"""Requests through a real stack, then ``perigee breakdown`` over the stack's spans file:
one trace per request across every service (NATS and ZeroMQ hops included), every
stage present, and the stages add up to the request's latency."""

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from perigee import breakdown as bd
from services.common.hashing import block_hashes
from services.common.tokenizer import Tokenizer
from tests.e2e.helpers import KVEventWatcher
from tests.e2e.sse import post

pytestmark = pytest.mark.e2e

PREAMBLE = " ".join(f"Rule {i}: traces follow the request across services." for i in range(40))
SERVICES = ["admission", "conductor", "decode-0", "gateway", "prefill-0", "store-d0", "store-p0"]
STAGE_SPANS = [
    "gateway.request",
    "admission.request",
    "conductor.schedule",
    "conductor.place",
    "prefill.task",
    "prefill.queue",
    "prefill.compute",
    "prefill.ship",
    "store.ship",
    "store.write",
    "prefill.first_token",
    "decode.task",
    "decode.load_kv",
    "decode.generate",
]


async def wait_for_traces(path: str, request_ids: list[str], timeout: float = 30.0):
    """The spans of these requests, once every service exported its part."""

    def ready():
        try:
            spans = bd.read_spans(path)
        except FileNotFoundError:
            return None
        traces = bd.by_trace(spans)
        found = {}
        for t in traces.values():
            r = bd.breakdown(t)
            names = {s["name"] for s in t}
            if r is not None and r.request_id in request_ids and set(STAGE_SPANS) <= names:
                found[r.request_id] = (r, t)
        return found if len(found) == len(request_ids) else None

    async with asyncio.timeout(timeout):
        while (found := ready()) is None:
            await asyncio.sleep(0.1)
    return found


async def wait_for_closes(path: str, trace_ids: set[str], timeout: float = 30.0):
    """Each of these traces' store.close spans, with the spans they are children of, once
    every trace has one and every parent is exported too: (closes, spans by id)."""

    def ready():
        spans = [s for s in bd.read_spans(path) if s["trace_id"] in trace_ids]
        by_id = {s["span_id"]: s for s in spans}
        closes = [s for s in spans if s["name"] == "store.close"]
        if {c["trace_id"] for c in closes} != trace_ids:
            return None
        return None if any(c["parent_id"] not in by_id for c in closes) else (closes, by_id)

    async with asyncio.timeout(timeout):
        while (found := ready()) is None:
            await asyncio.sleep(0.1)
    return found


async def test_breakdown_of_requests_through_the_stack(stack, tmp_path):
    tok = Tokenizer.from_dir(stack.cfg.model_dir)
    cold, warm = PREAMBLE + " Question one?", PREAMBLE + " Question two?"
    watcher = await KVEventWatcher().start(stack.nats_url)
    try:
        async with aiohttp.ClientSession() as http:
            st, _, b1 = await post(
                http, stack.url, {"prompt": cold, "max_tokens": 8, "ignore_eos": True}
            )
            assert st == 200, b1
            await watcher.wait_for(block_hashes(tok.encode(cold), stack.cfg.block_size)[:-1])
            st, _, b2 = await post(
                http, stack.url, {"prompt": warm, "max_tokens": 8, "ignore_eos": True}
            )
            assert st == 200, b2
    finally:
        await watcher.close()
    ids = [b1["id"], b2["id"]]
    found = await wait_for_traces(stack.spans_file, ids)

    for rid, body in zip(ids, (b1, b2), strict=True):
        r, spans = found[rid]
        assert r.services == SERVICES  # one trace, every service
        assert {s["trace_id"] for s in spans} == {r.trace_id}
        assert set(r.stages_ns) == set(bd.STAGES)
        assert all(v >= 0 for v in r.stages_ns.values())
        root = next(s for s in spans if s["name"] == "gateway.request")
        assert r.e2e_ns == root["end_ns"] - root["start_ns"]
        for stage in ("queue", "prefill_compute", "decode_load", "decode"):
            assert r.stages_ns[stage] > 0, (rid, stage)
        assert r.kv_ship_ns > 0
        a = root["attributes"]
        assert a["gen_ai.system"] == "perigee" and a["gen_ai.request.model"] == "tiny-llama"
        assert a["gen_ai.request.max_tokens"] == 8
        assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == 8
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        # ZeroMQ hops: the decode node's write grant (store.write) is a child of the
        # prefill node's store.lease, which the worker asked for as the compute started,
        # or, where that grant was closed idle before a ship came (a slow box), of the
        # store.ship that opened another (data_plane: a grant's span is a child of the
        # peer's request); each store.ship is a child of prefill.ship. How many grants
        # the ships take is the lease's business, not the trace's: at least one, the
        # lease's and at most one more per ship, every one in this trace.
        by_id = {s["span_id"]: s for s in spans}
        writes = [s for s in spans if s["name"] == "store.write"]
        assert writes
        assert all(by_id[w["parent_id"]]["name"] in ("store.lease", "store.ship") for w in writes)
        ships = [s for s in spans if s["name"] == "store.ship"]
        assert ships and all(by_id[s["parent_id"]]["name"] == "prefill.ship" for s in ships)
        assert len(writes) <= len(ships) + 1
    # The CLOSE of a write grant carries the request's trace too, so the decode node's
    # store.close joins it under the prefill node's span that ended the grant (it was a
    # trace of its own for every request, sampled at that store's root).
    closes, by_id = await wait_for_closes(stack.spans_file, {found[rid][0].trace_id for rid in ids})
    for c in closes:
        parent = by_id[c["parent_id"]]
        assert c["service"] == "store-d0" and parent["service"] == "store-p0", c
        assert parent["name"] in ("store.lease", "store.ship"), (c, parent)
    assert found[ids[0]][0].cached_tokens == 0
    assert found[ids[1]][0].hit > 0.5  # the preamble came from the prefill node's store

    out_json, out_png = tmp_path / "breakdown.json", tmp_path / "breakdown.png"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "perigee.cli",
            "breakdown",
            stack.spans_file,
            "--requests",
            "0",
            "--json",
            str(out_json),
            "--png",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert ids[0][:21] in cli.stdout and ids[1][:21] in cli.stdout
    data = json.loads(out_json.read_text())
    mine = {r["request_id"]: r for r in data["requests"] if r["request_id"] in ids}
    assert set(mine) == set(ids)
    assert all(set(r["stages_s"]) == set(bd.STAGES) for r in mine.values())
    hits = {g["prefix_hit"] for g in data["groups"]}
    assert "0%" in hits and ">=50%" in hits
    assert out_png.read_bytes()[:4] == b"\x89PNG"
