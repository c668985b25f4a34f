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
