import nats

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode, encode
from bus_schemas.requests import GenerateRequest, SamplingParams


def test_roundtrip_and_strict_decode():
    req = GenerateRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)
    )
    assert decode(encode(req), GenerateRequest) == req
    try:
        decode(b'{"request_id": "r1", "prompt_token_ids": [1], "bogus": 1}', GenerateRequest)
    except BadMessage as e:
        assert "bogus" in str(e)
    else:
        raise AssertionError("unknown field accepted")


async def test_real_nats_server(nats_url):
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.REQUESTS)
    await nc.publish(subjects.REQUESTS, b"x")
    msg = await sub.next_msg(timeout=2)
    assert msg.data == b"x"
    await nc.close()


async def test_a_readiness_probe_is_answered_empty_and_never_reaches_the_handler(nats_url):
    from services.common import bus
    from services.common.bus import ERROR_HEADER

    srv, cli = await bus.connect(nats_url, name="srv"), await bus.connect(nats_url, name="cli")
    subs = bus.Subscriptions(srv)
    handled: list = []

    async def handler(req, _m):
        handled.append(req)

    try:
        await subs.serve("t.probe", dict, handler)
        m = await cli.request("t.probe", b"", timeout=5, headers={bus.PROBE_HEADER: "ready"})
        assert m.data == b"" and not (m.headers and ERROR_HEADER in m.headers)
        bad = await cli.request("t.probe", b"", timeout=5)  # the same bytes, no header
        assert bad.headers and ERROR_HEADER in bad.headers
        # micro's convention too, as nats.micro.ServiceError reads it
        assert bad.headers[bus.MICRO_ERROR_CODE_HEADER] == "400"
        assert bad.headers[bus.MICRO_ERROR_HEADER]
        assert handled == []
    finally:
        await subs.close()
        await srv.close()
        await cli.close()


async def test_flush_soon_writes_what_was_published_before_the_caller_goes_on(nats_url):
    from services.common import bus

    nc = await bus.connect(nats_url, name="t")
    try:
        sub = await nc.subscribe("t.flush")
        await bus.flush_soon()
        req = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams())
        await bus.publish(nc, "t.flush", req)
        assert nc._pending_data_size > 0  # nats.py only queued it
        await bus.flush_soon()
        assert nc._pending_data_size == 0  # its flusher wrote it meanwhile
        assert decode((await sub.next_msg(timeout=5)).data, GenerateRequest) == req
    finally:
        await nc.close()
