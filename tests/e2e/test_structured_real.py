"""Structured output on the real model (issue 25): SmolLM2-135M-Instruct on vLLM, 1
prefill + 2 decode, through vLLM's own structured-output backend on both roles.

Every answer is constrained from its first token (sampled on prefill) to its last
(decode continues the same grammar from the tokens so far): ``response_format``
``json_schema`` (strict) and ``json_object``, vLLM's ``structured_outputs`` (regex,
choice) and the older ``guided_*`` names; each answer parses and validates, streamed or
not. Then a long schema-bound answer is streamed while the decode instance serving it is
SIGKILLed mid-answer: the request migrates (its new prefill and decode feed the answer so
far to the grammar before sampling) and the client's text still validates.
"""

import asyncio
import json
import re
import signal

import aiohttp
import jsonschema
import nats
import openai
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.requests import Accepted, GenerateRequest, StreamEvent
from perigee import models
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import real_model_marks

MODEL_DIR = models.default_model_dir()
pytestmark = real_model_marks()

NAME = models.DEFAULT_MODEL_NAME
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
# Long enough that the decode instance is killed well inside it.
LIST = {
    "type": "object",
    "properties": {
        "animals": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{3,10}$"},
            "minItems": 16,
            "maxItems": 16,
        }
    },
    "required": ["animals"],
    "additionalProperties": False,
}
KILL_AFTER = 10  # SSE chunks read when the decode instance is killed


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "structured",
        engine="vllm",
        prefill=1,
        decode=2,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        speedup="0.1",
        ttft_slo=60.0,
        tbt_slo=5.0,
        store_capacity_blocks=512,
        tool_call_parser="hermes",  # perigee up --tool-call-parser: tool_choice auto
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


async def test_every_constraint_holds_streamed_and_not(real_stack):
    s = real_stack
    async with client(s.url) as c:
        questions = (
            "What is the capital of France? Answer in JSON.",
            "Describe Tokyo in JSON.",
            "Tell me about a big city in Brazil.",
        )
        for q in questions:
            r = await c.chat.completions.create(
                model=NAME,
                messages=ask(q),
                temperature=0,
                max_tokens=128,
                response_format=schema_format(CITY),
            )
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
        # the same, sampled and streamed
        parts = []
        async for ch in await c.chat.completions.create(
            model=NAME,
            messages=ask(questions[1]),
            temperature=0.8,
            seed=7,
            max_tokens=128,
            response_format=schema_format(CITY),
            stream=True,
        ):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
        jsonschema.validate(json.loads("".join(parts)), CITY)
        obj = await c.chat.completions.create(
            model=NAME,
            messages=ask("Give a JSON object with your name and age."),
            temperature=0,
            max_tokens=160,
            response_format={"type": "json_object"},
        )
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        phone = await c.completions.create(
            model=NAME,
            prompt="My phone number is",
            temperature=0,
            max_tokens=16,
            extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
        )
        assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text), phone.choices[0].text
        pick = await c.chat.completions.create(
            model=NAME,
            messages=ask("Is the sky blue? Answer yes or no."),
            temperature=0,
            max_tokens=8,
            extra_body={"guided_choice": ["yes", "no", "maybe"]},
        )
        assert pick.choices[0].message.content in ("yes", "no", "maybe")
        bad = await asyncio.gather(
            c.chat.completions.create(
                model=NAME,
                messages=ask("x"),
                max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "a"}},
            ),
            return_exceptions=True,
        )
        assert isinstance(bad[0], openai.BadRequestError)


async def stream_answer(http, url: str, on_chunk=None) -> dict:
    body = {
        "model": NAME,
        "messages": ask("List sixteen animals as JSON."),
        "temperature": 0,
        "max_tokens": 256,
        "stream": True,
        "response_format": schema_format(LIST),
    }
    text, finish, rid, n = [], None, "", 0
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            assert "error" not in obj, obj
            rid = obj.get("id", rid)
            for ch in obj.get("choices", []):
                text.append((ch.get("delta") or {}).get("content") or "")
                finish = ch.get("finish_reason") or finish
            n += 1
            if on_chunk is not None:
                await on_chunk(n, rid)
    return {"text": "".join(text), "finish": finish, "id": rid}


async def test_schema_holds_after_decode_worker_is_killed_mid_answer(real_stack):
    s = real_stack
    nc = await nats.connect(s.nats_url)
    placed: dict[str, str] = {}
    migrated: list[GenerateRequest] = []

    async def on_event(m) -> None:
        if m.subject.count(".") < 3:
            return
        ev = decode(m.data, StreamEvent)
        if isinstance(ev, Accepted):
            placed[ev.request_id] = ev.decode_instance

    async def on_req(m) -> None:
        r = decode(m.data, GenerateRequest)
        if r.migration is not None:
            migrated.append(r)

    await nc.subscribe("perigee.gw.>", cb=on_event)
    await nc.subscribe(subjects.REQUESTS, cb=on_req)
    await nc.subscribe(subjects.INTAKE, cb=on_req)
    await nc.flush()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            killed: list[str] = []

            async def kill_its_decode(n: int, rid: str) -> None:
                if n == KILL_AFTER and not killed:
                    killed.append(placed[rid])
                    s.kill(killed[0], signal.SIGKILL)

            got = await stream_answer(http, s.url, kill_its_decode)
    finally:
        await nc.close()
    assert killed, "the answer ended before the kill"
    assert got["finish"] == "stop", got
    answer = json.loads(got["text"])
    jsonschema.validate(answer, LIST)
    [m] = [r for r in migrated if r.migration.of_request_id == got["id"]]
    assert m.migration.reason == "decode_died" and m.migration.resumed_tokens >= KILL_AFTER - 1
    assert m.sampling.structured is not None
    assert m.sampling.structured.answer_start == m.migration.prompt_tokens


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


async def test_tool_calls_with_the_openai_client(real_stack):
    """tool_choice named and required on the real model, streamed and not: every call
    names a given tool and its arguments validate against that tool's parameters."""
    s = real_stack
    msgs = ask("What is the weather in Paris, and what time is it there?")
    async with client(s.url) as c:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            kw = {
                "model": NAME,
                "messages": msgs,
                "tools": [WEATHER, TIME],
                "tool_choice": choice,
                "temperature": 0,
                "max_tokens": 160,
            }
            r = await c.chat.completions.create(**kw)
            calls = r.choices[0].message.tool_calls
            assert calls, r.choices[0]
            streamed: dict[int, dict] = {}
            async for ch in await c.chat.completions.create(stream=True, **kw):
                for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    cur = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        cur["name"] += tc.function.name or ""
                        cur["arguments"] += tc.function.arguments or ""
            got = [(t.function.name, json.loads(t.function.arguments)) for t in calls]
            assert [
                (v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed.items())
            ] == got
            for name, args in got:
                jsonschema.validate(args, PARAMS[name])
            if choice == "required":
                assert r.choices[0].finish_reason == "tool_calls"
            else:
                assert [n for n, _ in got] == ["get_weather"]
                assert r.choices[0].finish_reason == "stop"


async def test_auto_tool_choice_through_the_stacks_parser(real_stack):
    """perigee up --tool-call-parser hermes: tools without a tool_choice (auto) are
    served; the small model answers in text (it does not emit hermes calls), which comes
    back as content, streamed and not."""
    s = real_stack
    kw = {
        "model": NAME,
        "messages": ask("Say hello."),
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 16,
    }
    async with client(s.url) as c:
        r = await c.chat.completions.create(**kw)
        parts = []
        async for ch in await c.chat.completions.create(stream=True, **kw):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
    m = r.choices[0].message
    assert m.content and not m.tool_calls
    assert "".join(parts) == m.content
