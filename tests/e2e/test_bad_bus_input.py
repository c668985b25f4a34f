"""Garbage on every subject of a live stack: error replies where there is a reply
subject, log-and-drop where there is none, and every service keeps serving."""

import json

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from services.common.bus import ERROR_HEADER
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e

GARBAGE = [b"", b"not json", b"[1,2,3]", b'{"unknown_field": 1}', b"\xff\xfe\x00"]


def targets() -> list[str]:
    return [
        subjects.REQUESTS,
        subjects.SCHEDULE,
        subjects.CANCEL,
        subjects.prefill_tasks("prefill-0"),
        subjects.decode_tasks("decode-0"),
        subjects.conductor_events("conductor-0"),
        subjects.store_ctl("p0", "tx.allocate"),
        subjects.store_ctl("d0", "tx.commit"),
        subjects.store_ctl("p0", "tx.abort"),
        subjects.store_ctl("p0", "dump"),
        subjects.kv_events("p0"),
        subjects.load_report("prefill", "prefill-0"),
        subjects.load_report("decode", "decode-0"),
        subjects.store_announce("p0"),
    ]


async def test_unknown_field_on_request_subject_gets_error_event(stack):
    nc = await nats.connect(stack.nats_url)
    try:
        body = {"request_id": "bad-1", "prompt_token_ids": [1, 2, 3], "surprise": True}
        msg = await nc.request(subjects.REQUESTS, json.dumps(body).encode(), timeout=5)
        ev = json.loads(msg.data)
        assert ev["type"] == "error" and ev["code"] == 400
        assert "surprise" in ev["message"]
        assert ev["request_id"] == "bad-1"
    finally:
        await nc.close()


async def test_garbage_everywhere_then_a_normal_request_completes(stack):
    nc = await nats.connect(stack.nats_url)
    try:
        for subject in targets():
            for payload in GARBAGE:
                await nc.publish(subject, payload)  # no reply subject: logged and dropped
        # With a reply subject each answers with an error rather than hangs or drops it.
        for subject in (subjects.REQUESTS, subjects.SCHEDULE):
            msg = await nc.request(subject, b"{not json", timeout=5)
            ev = json.loads(msg.data)
            assert (ev["type"], ev["code"]) == ("error", 400), ev
            assert "json" in ev["message"].lower(), ev
        msg = await nc.request(subjects.store_ctl("p0", "tx.allocate"), b"{not json", timeout=5)
        assert msg.headers and msg.headers.get(ERROR_HEADER) == "bad_request", msg
        await nc.flush()
    finally:
        await nc.close()
    async with aiohttp.ClientSession() as s:
        r = await stream(
            s, stack.url, {"prompt": "after the garbage", "max_tokens": 3, "ignore_eos": True}
        )
    assert r.status == 200 and r.done, r.error
    assert not stack.exited()
