"""Tool calling at the gateway (issue 25): tools and tool_choice checked as vLLM checks
them, the constraint schema equal to vLLM's own, the chat template given the tools, and
answers turned into ``tool_calls`` in ``message`` and in streamed deltas, asserted with
the official ``openai`` client over HTTP (a fake backend plays the engines): named and
required (constrained), and auto through vLLM's hermes parser."""

import importlib.util
import json

import nats
import openai
import pytest

from bus_schemas.requests import Accepted, Finished, Tokens
from services.common.tokenizer import Tokenizer
from services.gateway.protocol import ApiError
from services.gateway.server import Gateway, GatewayConfig
from services.gateway.tools import ToolOutput, ToolRequest, parse_tools
from tests.unit.gateway.test_gateway_http import TOK, FakeBackend

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ([{"type": "function"}], None, "tools"),
        ([{"type": "function", "function": {"name": ""}}], "none", "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], None, "tool_choice"),  # auto (the default) needs a parser
        ([WEATHER], "auto", "tool_choice"),
    ],
)
def test_tools_refused_as_vllm_refuses(tools, choice, param):
    with pytest.raises(ApiError) as ei:
        parse_tools(tools, choice, None, None)
    assert ei.value.status == 400 and ei.value.param == param


def test_tool_choices():
    assert parse_tools(None, None, None, None) is None
    assert parse_tools(None, "none", None, None) is None
    assert parse_tools([WEATHER], "none", None, None).choice == "none"
    named = parse_tools(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, None
    )
    assert (named.choice, named.name) == ("function", "get_time")
    assert named.schema() == {"type": "object", "properties": {}}  # no parameters
    assert parse_tools([WEATHER], None, None, "hermes").choice == "auto"


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.parametrize("parallel", [None, False])
def test_constraint_schemas_equal_vllms(parallel):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, TIME],
            "tool_choice": choice,
            **({"parallel_tool_calls": parallel} if parallel is not None else {}),
        }
        req = ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
        want = get_json_schema_from_tools(req.tool_choice, req.tools, req.parallel_tool_calls)
        ours = parse_tools([WEATHER, TIME], choice, parallel, None).schema()
        assert ours == want, choice


def test_chat_template_sees_the_tools():
    cfg = {
        "chat_template": "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }}>{% endfor %}\n{% endfor %}",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    tok = Tokenizer(TOK._tok, cfg)
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    text = tok.apply_chat_template(msgs, tools=[WEATHER, TIME])
    assert text == "[get_weather][get_time]user:hiassistant:<get_weather>tool:sunny"
    assert tok.encode_chat(msgs, tools=[WEATHER]) == tok.encode(
        tok.apply_chat_template(msgs, tools=[WEATHER]), False
    )


def test_tool_output_named_and_required():
    named = ToolOutput(ToolRequest([WEATHER], "function", "get_weather"))
    msg, finish = named.message('{"city": "Paris"}', "stop")
    assert msg["content"] == "" and finish == "stop"  # OpenAI: "stop" for a named call
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    req = ToolOutput(ToolRequest([WEATHER, TIME], "required"))
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    msg, finish = req.message(text, "stop")
    assert finish == "tool_calls"
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    cut = ToolOutput(ToolRequest([WEATHER], "required"))
    msg, finish = cut.message('[{"name": "get_wea', "length")
    assert msg == {"role": "assistant", "content": '[{"name": "get_wea'} and finish == "length"


# ------------------------------------------------------------------ over HTTP, openai client


def answer_with(text: str):
    ids = TOK.encode(text, add_bos=False)

    async def behaviour(b, req, reply) -> None:
        rid = req.request_id
        await b.send(reply, Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"))
        await b.send(reply, Tokens(request_id=rid, token_ids=ids[:1], index=0))
        for i in range(1, len(ids), 3):  # a few tokens per event, as decode sends them
            await b.send(reply, Tokens(request_id=rid, token_ids=ids[i : i + 3], index=i))
        await b.send(
            reply,
            Finished(
                request_id=rid,
                finish_reason="stop",
                prompt_tokens=len(req.prompt_token_ids),
                completion_tokens=len(ids),
                cached_tokens=0,
            ),
        )

    return behaviour


@pytest.fixture
async def gw_with(nats_url):
    made = []

    async def make(behaviour, **cfg):
        nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
        gw = await Gateway(
            GatewayConfig(port=0, durable_intake=False, sweep_interval_s=0, **cfg),
            nc_gw,
            tokenizer=TOK,
        ).start()
        backend = await FakeBackend(nc_be, behaviour).start()
        made.append((gw, nc_gw, nc_be))
        c = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="x", max_retries=0
        )
        return c, backend

    yield make
    for gw, a, b in made:
        await gw.close()
        await a.close()
        await b.close()


async def _stream_calls(c, **kw) -> tuple[dict[int, dict], str, str]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    async for ch in await c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                if tc.function is not None:
                    cur["name"] += tc.function.name or ""
                    cur["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, content, finish


async def test_named_tool_call_with_the_openai_client(gw_with):
    c, backend = await gw_with(answer_with('{"city": "Paris"}'))
    kw = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 20,
    }
    r = await c.chat.completions.create(**kw)
    req, _ = backend.requests.get_nowait()
    assert json.loads(req.sampling.structured.json) == WEATHER["function"]["parameters"]
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert r.choices[0].finish_reason == "stop"
    calls, content, finish = await _stream_calls(c, **kw)
    assert content == "" and finish == "stop"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


async def test_required_tool_calls_with_the_openai_client(gw_with):
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    c, backend = await gw_with(answer_with(text))
    kw = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Time and weather in Rome?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "max_tokens": 60,
    }
    r = await c.chat.completions.create(**kw)
    req, _ = backend.requests.get_nowait()
    assert json.loads(req.sampling.structured.json)["type"] == "array"
    got = [
        (t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls
    ]
    assert got == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert r.choices[0].finish_reason == "tool_calls"
    calls, _, finish = await _stream_calls(c, **kw)
    assert finish == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == got


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tool parsers)")
async def test_auto_tool_calls_through_vllms_hermes_parser(gw_with):
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    c, backend = await gw_with(answer_with(text), tool_call_parser="hermes")
    kw = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [WEATHER],
        "max_tokens": 60,
    }
    r = await c.chat.completions.create(**kw)
    req, _ = backend.requests.get_nowait()
    assert req.sampling.structured is None  # auto is not constrained
    m = r.choices[0].message
    assert m.content == "Let me check."
    [call] = m.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Lima"},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    calls, content, finish = await _stream_calls(c, **kw)
    assert content == "Let me check." and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Lima"
    }


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tool parsers)")
async def test_auto_without_a_call_is_plain_content(gw_with):
    c2, _ = await gw_with(answer_with("It is sunny."), tool_call_parser="hermes")
    kw = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [WEATHER],
        "max_tokens": 60,
    }
    r2 = await c2.chat.completions.create(**kw)
    assert r2.choices[0].message.content == "It is sunny." and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason == "stop"


async def test_unknown_tool_call_parser_fails_at_start(nats_url):
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(ValueError, match="tool-call-parser"):
            Gateway(GatewayConfig(port=0, tool_call_parser="no-such-parser"), nc, tokenizer=TOK)
    finally:
        await nc.close()
