"""vLLM's sampling extensions and logprobs at the gateway (issue 25): parsed into the bus
SamplingParams within vLLM's bounds, bad words tokenized as vLLM's
``update_from_tokenizer`` does, stop strings kept on request, and engine logprobs shaped
as vLLM's OpenAI server shapes them."""

import json

import pytest

from bus_schemas.requests import SamplingParams, Tokens
from services.common.tokenizer import Tokenizer
from services.gateway.logprobs import LogprobsOut
from services.gateway.output import TextOutput
from services.gateway.protocol import ApiError, bad_words_token_ids, parse_chat, parse_completion
from services.gateway.resend import Resume, plan
from services.gateway.responses import Extras

V = 1024
MSG = [{"role": "user", "content": "x"}]
TOK = Tokenizer.from_dir()


def _parse(body: dict, chat: bool = False):
    body = {**body, **({"messages": MSG} if chat else {"prompt": body.get("prompt", "x")})}
    return (parse_chat if chat else parse_completion)(json.dumps(body).encode(), V)


def _err(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as ei:
        _parse(body, chat)
    assert ei.value.status == 400
    return ei.value


@pytest.mark.parametrize("chat", [False, True])
def test_engine_fields_reach_the_bus(chat):
    p = _parse(
        {
            "min_tokens": 3,
            "logit_bias": {"5": 150, "7": -2.5},
            "allowed_token_ids": [5, 7, 7, 9],
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "stop": ["!"],
        },
        chat,
    )
    s = p.sampling(10)
    assert s.min_tokens == 3
    assert s.logit_bias == {5: 100.0, 7: -2.5}  # vLLM clamps to [-100, 100]
    assert s.allowed_token_ids == [5, 7, 9]
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert s.logprobs is None and s.prompt_logprobs is None


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(V): 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [V]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_engine_fields_out_of_bounds(body, param, chat):
    assert _err(body, chat).param == param


def test_min_tokens_above_max_tokens_is_refused_once_max_tokens_is_known():
    p = _parse({"min_tokens": 8})
    with pytest.raises(ApiError) as ei:
        p.sampling(4)
    assert ei.value.param == "min_tokens"
    assert p.sampling(8).min_tokens == 8


def test_logprobs_fields():
    c = _parse({"logprobs": 2, "echo": True})
    s = c.sampling(1)
    assert (s.logprobs, s.prompt_logprobs, c.echo) == (2, 2, True)  # vLLM: echo scores the prompt
    assert _parse({"logprobs": 0}).sampling(1).prompt_logprobs is None
    chat = _parse({"logprobs": True, "top_logprobs": 3}, chat=True)
    assert chat.sampling(1).logprobs == 3
    assert _parse({"logprobs": True}, chat=True).sampling(1).logprobs == 0
    assert _parse({"logprobs": False, "top_logprobs": 0}, chat=True).logprobs is None
    assert _err({"logprobs": False, "top_logprobs": 2}, chat=True).param == "top_logprobs"
    assert _err({"logprobs": 21}).param == "logprobs"
    assert _err({"logprobs": True, "top_logprobs": 21}, chat=True).param == "logprobs"
    assert _err({"logprobs": -2}).param == "logprobs"
    assert _err({"echo": True, "stream": True}).code == "unsupported_parameter"


def test_bad_words_tokenize_as_vllm_does():
    enc = lambda w: TOK.encode(w, add_bos=False)  # noqa: E731
    ids = bad_words_token_ids(enc, ["hello", " world"])
    # each word as is, then with a leading space when that is another sequence of the
    # same length
    assert ids[0] == enc("hello")
    assert enc(" hello") in ids or len(enc(" hello")) != len(enc("hello"))
    assert enc("world") in ids  # the word is stripped first
    with pytest.raises(ApiError):
        bad_words_token_ids(enc, ["a"], limit=1)


def test_sampling_params_bounds_on_the_wire():
    assert SamplingParams(min_tokens=5, max_tokens=4).problem()[0] == "min_tokens"
    assert SamplingParams(logit_bias={1: 101.0}).problem()[0] == "logit_bias"
    assert SamplingParams(allowed_token_ids=[]).problem()[0] == "allowed_token_ids"
    assert SamplingParams(bad_words_token_ids=[[]]).problem()[0] == "bad_words"
    assert SamplingParams(prompt_logprobs=21).problem()[0] == "prompt_logprobs"
    s = SamplingParams(stop_token_ids=[1], logit_bias={2: 1.0}, bad_words_token_ids=[[3, 4]])
    assert sorted(s.token_ids_used()) == [1, 2, 3, 4]


def test_include_stop_str_in_output():
    def run(include: bool) -> str:
        t = TextOutput(TOK.detokenizer(), ["world"], include_stop=include)
        ids = TOK.encode("hello world and more", add_bos=False)
        return t.push(ids) + t.finish()

    assert run(False) == "hello "
    assert run(True) == "hello world"


def test_skip_special_tokens_off_keeps_them():
    eos = TOK.eos_id
    ids = [*TOK.encode("hi", add_bos=False), eos]
    assert eos in TOK.special_ids
    kept = TextOutput(TOK.detokenizer(False))
    assert (kept.push(ids) + kept.finish()).endswith(TOK.eos_token)
    dropped = TextOutput(TOK.detokenizer(True))
    assert dropped.push(ids) + dropped.finish() == "hi"


def _dec(t: int) -> str:
    return f"<{t}>"


def test_chat_logprobs_shape():
    out = LogprobsOut(_dec, chat=True, k=1)
    part = out.add([5, 6], [[(5, -0.1), (9, -2.0)], [(6, -0.5), (5, -1.0)]])
    assert part["content"][0] == {
        "token": "<5>",
        "logprob": -0.1,
        "bytes": list(b"<5>"),
        "top_logprobs": [{"token": "<5>", "logprob": -0.1, "bytes": list(b"<5>")}],
    }
    assert out.body()["content"][1]["logprob"] == -0.5
    assert len(out.body()["content"]) == 2


def test_completion_logprobs_shape_with_echo():
    out = LogprobsOut(_dec, chat=False, k=1)
    out.add([1, 2], [None, [(2, -3.0), (4, -0.2), (8, -4.0)]])  # the prompt
    part = out.add([3], [[(3, -0.7), (4, -0.9)]])
    assert part == {
        "text_offset": [6],
        "token_logprobs": [-0.7],
        "tokens": ["<3>"],
        "top_logprobs": [{"<3>": -0.7, "<4>": -0.9}],
    }
    body = out.body()
    assert body["tokens"] == ["<1>", "<2>", "<3>"]
    assert body["token_logprobs"] == [None, -3.0, -0.7]
    assert body["top_logprobs"][0] is None
    assert body["top_logprobs"][1] == {"<2>": -3.0, "<4>": -0.2}  # logprobs + 1 entries
    assert body["text_offset"] == [0, 3, 6]


def test_extras_align_logprobs_with_tokens_on_duplicates_and_stops():
    text = TextOutput(TOK.detokenizer(), ["b"])
    ids = TOK.encode("a b", add_bos=False)
    lp = [[(t, -1.0 * (i + 1))] for i, t in enumerate(ids)]
    ex = Extras(logprobs=LogprobsOut(_dec, chat=False, k=0), echo_text="P", prompt_ids=[7])
    ev = Tokens(request_id="r", token_ids=ids[:1], index=0, logprobs=lp[:1], prompt_logprobs=[None])
    ex.push(text, ev)
    ex.push(text, ev)  # a duplicate delivery adds nothing
    ex.push(text, Tokens(request_id="r", token_ids=ids, index=0, logprobs=lp))
    body = ex.logprobs.body()
    # the prompt's entry, then one per token the client got (up to the stop string's)
    assert body["token_logprobs"] == [None, *[x[0][1] for x in lp[: text.completion_tokens]]]


def test_migration_counts_min_tokens_and_drops_prompt_logprobs_once_sent():
    from bus_schemas.requests import GenerateRequest

    req = GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=10, min_tokens=4, prompt_logprobs=1, logprobs=1),
    )
    d = plan(
        req, [5, 6], attempts=0, limit=3, dead_role="decode", dead_instance="d", reply_subject="x"
    )
    assert isinstance(d, Resume)
    s = d.request.sampling
    assert (s.max_tokens, s.min_tokens, s.prompt_logprobs, s.logprobs) == (8, 2, None, 1)
    d0 = plan(
        req, [], attempts=0, limit=3, dead_role="prefill", dead_instance="p", reply_subject="x"
    )
    assert d0.request.sampling.prompt_logprobs == 1


# ------------------------------------------------------------------ over HTTP (fake backend)

from tests.unit.gateway.test_gateway_http import (  # noqa: E402
    OUT_IDS,
    env,  # noqa: F401 - fixture
    read_sse,
    stack_ready,
)


def _lp(t: int) -> list[tuple[int, float]]:
    return [(t, -0.25), (t + 1, -1.5), (t + 2, -2.5)]


async def serve_logprobs(b, req, reply) -> None:
    from bus_schemas.requests import Accepted, Finished

    rid, n = req.request_id, len(req.prompt_token_ids)
    await b.send(reply, Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"))
    plps = (
        [None, *[_lp(t) for t in req.prompt_token_ids[1:]]]
        if req.sampling.prompt_logprobs is not None
        else None
    )
    want = req.sampling.logprobs is not None
    first = Tokens(
        request_id=rid,
        token_ids=OUT_IDS[:1],
        index=0,
        logprobs=[_lp(OUT_IDS[0])] if want else None,
        prompt_logprobs=plps,
    )
    await b.send(reply, first)
    rest = OUT_IDS[1:3]
    await b.send(
        reply,
        Tokens(
            request_id=rid,
            token_ids=rest,
            index=1,
            logprobs=[_lp(t) for t in rest] if want else None,
        ),
    )
    await b.send(
        reply,
        Finished(
            request_id=rid,
            finish_reason="length",
            prompt_tokens=n,
            completion_tokens=3,
            cached_tokens=0,
        ),
    )


async def test_completion_echo_logprobs_over_http(env):  # noqa: F811
    env.set_behaviour(serve_logprobs)
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1, "echo": True}
    async with env.post("/v1/completions", body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    req, _ = env.backend.requests.get_nowait()
    assert (req.sampling.logprobs, req.sampling.prompt_logprobs) == (1, 1)
    c = out["choices"][0]
    assert c["text"].startswith(TOK.decode([1, 2, 3], skip_special_tokens=False))
    lp = c["logprobs"]
    assert len(lp["tokens"]) == 3 + 3
    assert lp["token_logprobs"] == [None, -0.25, -0.25, -0.25, -0.25, -0.25]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2


async def test_chat_logprobs_streamed_over_http(env):  # noqa: F811
    env.set_behaviour(serve_logprobs)
    body = {
        "messages": MSG,
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
    }
    async with env.post("/v1/chat/completions", body) as r:
        assert r.status == 200
        chunks, done = await read_sse(r)
    assert done
    content = [
        e
        for c in chunks
        for ch in c["choices"]
        if ch["logprobs"]
        for e in ch["logprobs"]["content"]
    ]
    assert [e["token"] for e in content] == [
        TOK.decode([t], skip_special_tokens=False) for t in OUT_IDS[:3]
    ]
    assert all(e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2 for e in content)


async def test_tokenize_and_detokenize(env):  # noqa: F811
    async with env.post("/tokenize", {"prompt": "Hello world"}) as r:
        out = await r.json()
    assert out["tokens"] == TOK.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 128 and out["token_strs"] is None
    async with env.post(
        "/tokenize",
        {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True},
    ) as r:
        out = await r.json()
    assert out["tokens"] == TOK.encode("Hello world", add_bos=False)
    assert out["token_strs"] == [TOK.id_to_token(t) for t in out["tokens"]]
    async with env.post("/tokenize", {"messages": MSG}) as r:
        out = await r.json()
    assert out["tokens"] == TOK.encode_chat([{"role": "user", "content": "x"}])
    async with env.post("/detokenize", {"tokens": TOK.encode("Hello world", add_bos=False)}) as r:
        assert (await r.json()) == {"prompt": "Hello world"}
    for path, body, status in (
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "x", "messages": MSG}, 400),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404),
        ("/detokenize", b"{", 400),
    ):
        async with env.post(path, body) as r:
            assert r.status == status, (path, body)


async def test_models_lists_max_model_len(env):  # noqa: F811
    await stack_ready(env)
    async with env.http.get(env.base + "/v1/models") as r:
        card = (await r.json())["data"][0]
    assert card["max_model_len"] == 128


# ------------------------------------------------------------------ structured output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("body", "want"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": json.dumps(SCHEMA)},
        ),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
        ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": json.dumps(SCHEMA)}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
        ({"guided_regex": "b+"}, {"regex": "b+"}),
        ({"guided_choice": ["p"]}, {"choice": ["p"]}),
        ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_structured_output_fields_reach_the_bus(body, want, chat):
    so = _parse(body, chat).sampling(4).structured
    if want is None:
        assert so is None
    else:
        assert so is not None and so.kinds() == 1 and so.answer_start == 0
        assert {k: v for k, v in msgspec_to_dict(so).items() if k in want} == want


def msgspec_to_dict(x) -> dict:
    import msgspec

    return msgspec.structs.asdict(x)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "structural_tag": "t"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_structured_output_refusals(body, param):
    assert _err(body).param == param


def test_migration_resumes_the_grammar_past_the_original_prompt():
    from bus_schemas.requests import GenerateRequest, StructuredOutput

    req = GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=10, structured=StructuredOutput(regex="a+")),
    )
    d = plan(
        req, [5, 6], attempts=0, limit=3, dead_role="decode", dead_instance="d", reply_subject="x"
    )
    assert d.request.sampling.structured.answer_start == 3
    again = plan(
        d.request,
        [5, 6, 7],
        attempts=1,
        limit=3,
        dead_role="decode",
        dead_instance="d2",
        reply_subject="y",
    )
    assert again.request.sampling.structured.answer_start == 3  # the client's prompt still


def test_the_token_that_ends_the_answer_is_not_shown():
    """vLLM leaves a stop token out of the text, special or not, unless
    include_stop_str_in_output; one that did not stop (ignore_eos) is text."""
    ids = TOK.encode("hi there", add_bos=False)
    stop = ids[-1]
    shown = TextOutput(TOK.detokenizer(False), hidden=frozenset({stop, TOK.eos_id}))
    assert shown.push([*ids, TOK.eos_id]) + shown.finish() == TOK.decode(ids[:-1])
    assert shown.completion_tokens == len(ids) + 1  # counted all the same
    kept = TextOutput(TOK.detokenizer(False))
    assert (kept.push([*ids, TOK.eos_id]) + kept.finish()).endswith(TOK.eos_token)
