import json

import pytest

from services.common.tokenizer import Tokenizer
from services.gateway.output import StopStrings, TextOutput
from services.gateway.protocol import ApiError, ChunkWriter, parse_chat, parse_completion, usage

V = 1024
TOK = Tokenizer.from_dir()


def _err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(body if isinstance(body, bytes) else json.dumps(body).encode(), V)
    assert ei.value.status == 400
    assert ei.value.body()["error"]["type"] == "invalid_request_error"
    return ei.value


def test_completion_prompt_forms():
    p = parse_completion(b'{"prompt": "hi", "max_tokens": 5, "whatever": {"x": 1}}', V)
    assert (p.prompt_text, p.prompt_ids, p.max_tokens, p.chat) == ("hi", None, 5, False)
    assert parse_completion(b'{"prompt": ["hi"]}', V).prompt_text == "hi"
    assert parse_completion(b'{"prompt": [5, 6]}', V).prompt_ids == [5, 6]
    assert parse_completion(b'{"prompt": [7]}', V).prompt_ids == [7]
    assert parse_completion(b'{"prompt": [[5, 6]]}', V).prompt_ids == [5, 6]
    p = parse_completion(
        b'{"prompt": "x", "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\\n", '
        b'"stop_token_ids": [2], "ignore_eos": true, "stream": true, '
        b'"stream_options": {"include_usage": true}, "n": 1, "user": "u"}',
        V,
    )
    assert (p.temperature, p.top_p, p.seed, p.stop, p.stop_token_ids) == (0.0, 0.5, 3, ["\n"], [2])
    assert (p.ignore_eos, p.stream, p.include_usage) == (True, True, True)


def test_completion_errors():
    assert _err(parse_completion, b"{not json").param is None
    assert _err(parse_completion, {"prompt": "x", "max_tokens": "5"}).param == "max_tokens"
    assert _err(parse_completion, {"max_tokens": 5}).param == "prompt"
    assert _err(parse_completion, {"prompt": "x", "n": 0}).param == "n"
    assert _err(parse_completion, {"prompt": ["a", "b"]}).param == "prompt"
    assert _err(parse_completion, {"prompt": []}).param == "prompt"
    assert _err(parse_completion, {"prompt": [1, 5000]}).param == "prompt"
    assert _err(parse_completion, {"prompt": [1, True]}).param == "prompt"
    assert _err(parse_completion, {"prompt": "x", "temperature": 3}).param == "temperature"
    assert _err(parse_completion, {"prompt": "x", "top_p": 0}).param == "top_p"
    assert _err(parse_completion, {"prompt": "x", "stream_options": {}}).param == "stream_options"
    assert (
        _err(parse_completion, {"prompt": "x", "stop_token_ids": [1024]}).param == "stop_token_ids"
    )
    _err(parse_completion, [1, 2])


def test_chat_parse():
    p = parse_chat(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": None, "tool_calls": []},
                ],
                "max_completion_tokens": 7,
                "max_tokens": 99,
            }
        ).encode(),
        V,
    )
    assert p.chat and p.max_tokens == 7
    assert p.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert (
        parse_chat(
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}', V
        ).max_tokens
        == 3
    )
    assert _err(parse_chat, {"messages": []}).param == "messages"
    assert _err(parse_chat, {"messages": [{"role": "wizard", "content": "x"}]}).param == "messages"
    img = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
    assert _err(parse_chat, {"messages": [img]}).param == "messages"
    assert _err(parse_chat, {"messages": "hi"}).param == "messages"


def test_stop_strings_hold_back_only_possible_prefixes():
    s = StopStrings(["END", "\n\n"])
    assert s.feed("abc") == ("abc", False)
    assert s.feed("xE") == ("x", False)  # "E" may start "END"
    assert s.feed("N") == ("", False)
    assert s.feed("Q") == ("ENQ", False)
    assert s.feed("a\n") == ("a", False)
    assert s.feed("b") == ("\nb", False)
    assert s.feed("zzEN") == ("zz", False)
    assert s.feed("Dtail") == ("", True)
    s = StopStrings(["ab"])
    assert s.feed("xa") == ("x", False)
    assert s.flush() == "a"


def test_text_output_stop_counts_tokens_and_dedupes():
    ids = TOK.encode("Hello world. More text", add_bos=False)
    out = TextOutput(TOK.detokenizer(), ["."])
    text = out.push(ids[:2], 0) + out.push(ids[:2], 0) + out.push(ids[2:], 2)
    assert text == "Hello world" and out.stopped
    upto = next(i for i in range(len(ids)) if "." in TOK.decode(ids[: i + 1]))
    assert out.completion_tokens == upto + 1
    assert out.push(ids, len(ids)) == "" and out.finish() == ""
    out = TextOutput(TOK.detokenizer())
    assert out.push(ids, 0) + out.finish() == "Hello world. More text"
    assert out.completion_tokens == len(ids)


def test_chunk_shapes():
    w = ChunkWriter("chatcmpl-1", 5, "m", chat=True, include_usage=True)
    role = json.loads(w.role()[6:])
    assert role == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    assert json.loads(w.text("", "stop")[6:])["choices"][0]["delta"] == {}
    u = json.loads(w.usage(usage(3, 2, 1))[6:])
    assert u["choices"] == [] and u["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    w = ChunkWriter("cmpl-1", 5, "m", chat=False, include_usage=False)
    c = json.loads(w.text("hi")[6:])
    assert c == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}],
    }
    assert w.usage(usage(1, 1, 0)) == b""
