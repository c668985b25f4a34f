"""The admission service in-process on a real nats-server: stream-protocol errors for bad
input, 429/503 from early rejection, and forwarding with the fields filled in."""

import asyncio
import contextlib
import time

import nats
import nats.js.errors
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import Error, ErrorCode, GenerateRequest, stream_event_decoder
from services.admission.admission_policy import PredictiveRejectionPolicy
from services.admission.service import AdmissionConfig, AdmissionService
from services.common import intake_queue
from services.common.cost_fit import FittedCostModel, PrefillSample, fit_cost_model
from services.common.cost_model import CostModel
from services.common.hashing import block_hashes

PROMPT = list(range(1, 80))


class Harness:
    async def start(self, url: str, **cfg) -> "Harness":
        self.nc = await nats.connect(url)
        self.anc = await nats.connect(url)
        # Forwards are followed on the work queue (the core path's forward:
        # tests/unit/common/test_intake_queue.py).
        cfg.setdefault("durable_intake", True)
        self.svc = AdmissionService(self.anc, AdmissionConfig(**cfg))
        await self.svc.start()
        self.inbox = self.nc.new_inbox()
        self.events = await self.nc.subscribe(self.inbox)
        self.scheduled = await self.nc.subscribe(subjects.SCHEDULE_QUEUE)
        return self

    async def loads(self, prefill_work: float) -> None:
        p = PrefillLoad(
            instance="prefill-0",
            node="n0",
            queue_len=0,
            queued_tokens=0,
            queued_work_s=prefill_work,
            ts=time.time(),
        )
        d = DecodeLoad(
            instance="decode-0",
            node="n1",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0,
            ts=time.time(),
        )
        await self.nc.publish(subjects.load_report("prefill", "prefill-0"), encode(p))
        await self.nc.publish(subjects.load_report("decode", "decode-0"), encode(d))
        pol = self.svc.policy

        async def seen():
            while not (pol.prefill.get("prefill-0") == p and pol.decode.get("decode-0") == d):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(seen(), 5)

    async def send(self, payload: bytes, reply: str | None = None) -> None:
        await self.nc.publish(
            subjects.REQUESTS, payload, reply=self.inbox if reply is None else reply
        )

    async def event(self):
        m = await self.events.next_msg(timeout=5)
        return stream_event_decoder().decode(m.data)

    async def close(self) -> None:
        await self.svc.stop()
        await self.anc.close()
        # What it forwarded stays on the session server's work queue: leave it empty.
        with contextlib.suppress(nats.js.errors.NotFoundError):  # none without the intake
            await self.nc.jetstream().purge_stream(intake_queue.SCHEDULE_STREAM)
        await self.nc.close()


@pytest.fixture
async def admission(nats_url):
    h = await Harness().start(
        nats_url, block_size=32, ttft_slo_s=30.0, tbt_slo_s=0.1, policy="early"
    )
    yield h
    await h.close()


async def test_malformed_json_gets_a_400_error_event(admission):
    await admission.send(b'{"request_id": "x", "prompt_token_ids": [1, 2')
    err = await admission.event()
    assert isinstance(err, Error) and err.code == ErrorCode.BAD_REQUEST and err.request_id == ""
    # Well-formed JSON that breaks the schema: the request id is salvaged.
    await admission.send(b'{"request_id": "r-bad", "prompt_token_ids": [1], "bogus": true}')
    err = await admission.event()
    assert (err.request_id, err.code) == ("r-bad", ErrorCode.BAD_REQUEST) and "bogus" in err.message
    # No NATS reply, but the struct names where events go.
    await admission.send(
        b'{"request_id": "r-b2", "reply_subject": "%s"}' % admission.inbox.encode(), reply=""
    )
    err = await admission.event()
    assert (err.request_id, err.code) == ("r-b2", ErrorCode.BAD_REQUEST)


async def test_empty_prompt_and_bad_hashes_are_400(admission):
    await admission.send(encode(GenerateRequest(request_id="e", prompt_token_ids=[])))
    err = await admission.event()
    assert (err.request_id, err.code, err.message) == ("e", ErrorCode.BAD_REQUEST, "empty prompt")
    await admission.send(
        encode(GenerateRequest(request_id="h", prompt_token_ids=PROMPT, block_hashes=[1]))
    )
    err = await admission.event()
    assert (err.request_id, err.code) == (
        "h",
        ErrorCode.BAD_REQUEST,
    ) and "block_hashes" in err.message


async def test_no_live_instance_is_503(admission):
    await admission.send(encode(GenerateRequest(request_id="u", prompt_token_ids=PROMPT)))
    err = await admission.event()
    assert (err.request_id, err.code) == ("u", ErrorCode.UNAVAILABLE)


async def test_overloaded_prefill_pool_is_429(admission):
    await admission.loads(prefill_work=100.0)
    await admission.send(encode(GenerateRequest(request_id="o", prompt_token_ids=PROMPT)))
    err = await admission.event()
    assert (err.request_id, err.code) == ("o", ErrorCode.REJECTED)
    assert err.retry_after_s == pytest.approx(70.0)
    # Once the pool drains, requests pass; the rejected one was never forwarded.
    await admission.loads(prefill_work=0.0)
    await admission.send(encode(GenerateRequest(request_id="ok", prompt_token_ids=PROMPT)))
    fwd = decode((await admission.scheduled.next_msg(timeout=5)).data, GenerateRequest)
    assert fwd.request_id == "ok"


async def test_accepted_request_is_forwarded_filled_in(admission):
    await admission.loads(prefill_work=1.0)
    await admission.send(encode(GenerateRequest(request_id="a", prompt_token_ids=PROMPT)))
    m = await admission.scheduled.next_msg(timeout=5)
    fwd = decode(m.data, GenerateRequest)
    assert fwd.request_id == "a" and fwd.prompt_token_ids == PROMPT
    assert fwd.reply_subject == admission.inbox
    assert fwd.block_size == 32 and fwd.block_hashes == block_hashes(PROMPT, 32)
    assert fwd.arrival_ts > 0
    # A client-chosen block size and arrival time are kept.
    req = GenerateRequest(request_id="b", prompt_token_ids=PROMPT, block_size=16, arrival_ts=5.0)
    await admission.send(encode(req))
    fwd = decode((await admission.scheduled.next_msg(timeout=5)).data, GenerateRequest)
    assert (fwd.block_size, fwd.block_hashes, fwd.arrival_ts) == (16, block_hashes(PROMPT, 16), 5.0)


async def test_predict_policy_tracks_what_it_forwards(nats_url):
    h = await Harness().start(nats_url, block_size=32, policy="predict", decode_time_s=7.0)
    try:
        assert (
            isinstance(h.svc.policy, PredictiveRejectionPolicy)
            and h.svc.policy.decode_time_s == 7.0
        )
        await h.loads(0.0)
        req = GenerateRequest(request_id="p1", prompt_token_ids=PROMPT)
        await h.send(encode(req))
        fwd = decode((await h.scheduled.next_msg(timeout=5)).data, GenerateRequest)
        assert fwd.request_id == "p1"
        assert set(h.svc.policy.admitted) == {"p1"}
    finally:
        await h.close()


def test_cost_model_option_loads_a_fitted_model(tmp_path):
    path = tmp_path / "cm.json"
    fit_cost_model(
        [
            PrefillSample(n, p, CostModel().prefill_time(n, p))
            for n in (256, 1024, 4096)
            for p in (0, n // 4, n // 2)
        ]
    ).save(path)
    svc = AdmissionService(None, AdmissionConfig(cost_model=str(path), speedup=5.0))
    assert isinstance(svc.policy.cost, FittedCostModel) and svc.policy.cost.speedup == 5.0


async def test_role_switch_on_the_bus_drops_the_instance_old_role(nats_url):
    from bus_schemas.control import RoleSwitch

    h = await Harness().start(nats_url)
    try:
        await h.loads(prefill_work=0.0)
        await h.nc.publish(
            subjects.CTL_ROLE, encode(RoleSwitch(instance="prefill-0", role="decode"))
        )
        await h.nc.flush()

        async def gone():
            while "prefill-0" in h.svc.policy.prefill:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(gone(), 5)
        assert "decode-0" in h.svc.policy.decode
    finally:
        await h.close()


async def test_a_hash_count_off_the_prompt_is_refused_at_either_door(admission):
    """Admission is where the block hashes are checked (once): a count that does not
    match the prompt's full blocks is a 400 naming both numbers, on core NATS and on
    the durable intake alike, and nothing of it reaches the conductors; the pools are
    healthy, so it is the check that refuses."""
    await admission.loads(prefill_work=1.0)
    two_blocks = list(range(1, 70))  # 2 full blocks of 32 and a tail
    want = "block_hashes has 3 entries, the prompt has 2 full blocks of 32"
    bad = GenerateRequest(request_id="h1", prompt_token_ids=two_blocks, block_hashes=[1, 2, 3])
    await admission.send(encode(bad))
    err = await admission.event()
    assert (err.request_id, err.code, err.message) == ("h1", ErrorCode.BAD_REQUEST, want)
    js = admission.nc.jetstream()
    stored = GenerateRequest(
        request_id="h2",
        prompt_token_ids=two_blocks,
        block_size=32,
        block_hashes=[1],
        reply_subject=admission.inbox,
    )
    await js.publish(subjects.INTAKE, encode(stored), headers={"Nats-Msg-Id": "h2"})
    err = await admission.event()
    assert (err.request_id, err.code) == ("h2", ErrorCode.BAD_REQUEST)
    assert err.message == "block_hashes has 1 entries, the prompt has 2 full blocks of 32"
    # The same prompt with its own hashes passes: only what was refused stayed behind.
    ok = GenerateRequest(
        request_id="h3", prompt_token_ids=two_blocks, block_hashes=block_hashes(two_blocks, 32)
    )
    await admission.send(encode(ok))
    fwd = decode((await admission.scheduled.next_msg(timeout=5)).data, GenerateRequest)
    assert fwd.request_id == "h3"
