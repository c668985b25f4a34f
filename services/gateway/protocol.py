"""OpenAI request bodies in, OpenAI response bodies out: pure functions, no I/O.

Request bodies decode with msgspec into typed structs; a wrong type or a malformed body
raises :class:`ApiError` (HTTP 400 with OpenAI's ``{"error": {message, type, param,
code}}``). Every field vLLM's OpenAI server knows is either served, within the bounds
vLLM enforces (:meth:`bus_schemas.requests.SamplingParams.problem`, shared with
admission and the engine), or refused with a 400 naming it when set to anything but
its neutral value (:data:`UNSUPPORTED`): a client asking for logprobs or tools is told,
not silently ignored. Fields neither knows are ignored, as vLLM does. Served
extensions (vLLM's names): ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``.
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bus_schemas.requests import MAX_BAD_WORDS, MAX_N, SamplingParams, StructuredOutput

# ---------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------- bodies


class StreamOptions(msgspec.Struct, kw_only=True):
    """OpenAI's ``stream_options``: whether the last chunk carries usage."""

    include_usage: bool | None = False


# Known fields this server does not serve, each with its neutral values: any other value
# is a 400 naming the field. (No logprobs, tools, structured output, beam search,
# penalties on generated tokens: the decode engine sees the first token, which prefill
# made, as prompt, so presence/frequency penalties would miss it.)
def _unset(v: Any) -> bool:
    return v is None


def _off(v: Any) -> bool:
    return v is None or v is False


def _on(v: Any) -> bool:
    return v is None or v is True


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, list | dict | str) and not v)


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 1)


def _text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


def _no_tool(v: Any) -> bool:
    return v is None or v in ("none", "auto")


Neutral = Callable[[Any], bool]
UNSUPPORTED: dict[str, Neutral] = {
    "prompt_logprobs": _unset,  # served through completions' echo + logprobs
    "logprob_token_ids": _empty,
    # best_of: vLLM 0.32's SamplingParams has none and its OpenAI server drops the field;
    # checked against n in _common (equal to n is what vLLM's answer amounts to).
    "suffix": _empty,
    "use_beam_search": _off,
    "length_penalty": _one,
    "spaces_between_special_tokens": _on,
    "truncate_prompt_tokens": _unset,
    "truncation_side": _unset,
    "prompt_embeds": _unset,
    "guided_decoding_backend": _unset,
    "guided_whitespace_pattern": _unset,
    "priority": _zero,
    "logits_processors": _empty,
    "vllm_xargs": _empty,
    "kv_transfer_params": _unset,
    "ec_transfer_params": _unset,
    "repetition_detection": _unset,
    "thinking_token_budget": _unset,
    "watermarking": _off,
    "return_tokens_as_token_ids": _off,
    "return_token_ids": _off,
    "return_token_offsets": _off,
    "cache_salt": _unset,
    "stream_interval": _one,
}
UNSUPPORTED_COMPLETION: dict[str, Neutral] = {
    **UNSUPPORTED,
    "add_special_tokens": _on,
    "top_logprobs": _zero,
}
UNSUPPORTED_CHAT: dict[str, Neutral] = {
    **UNSUPPORTED,
    "echo": _off,
    "add_special_tokens": _off,
    "functions": _empty,
    "function_call": _no_tool,
    "add_generation_prompt": _on,
    "continue_final_message": _off,
    "documents": _empty,
    "chat_template": _unset,
    "chat_template_kwargs": _empty,
    "mm_processor_kwargs": _empty,
    "media_io_kwargs": _empty,
    "audio": _unset,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": _unset,
}
MAX_STOP_STRINGS = 32  # each is searched on every token at the gateway
MAX_STOP_TOKEN_IDS = 256  # they ride on every bus message of the request
# Chat messages in one request (the gateway's --max-messages): the template renders each
# one in Python. vLLM sets none; no chat of more fits the default 8,192-token prompt
# limit anyway with the few tokens of markup each message costs.
MAX_MESSAGES = 1024
PENALTY_RANGE = 2.0  # presence/frequency: vLLM's [-2, 2]


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: Any = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # structured output (services.gateway.structured)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def _with_unsupported(name: str, base: type, names: dict[str, Neutral]) -> type:
    """``base`` plus each name in ``names`` as an ``Any`` field: decoded whatever its type,
    then checked against its neutral values."""
    return msgspec.defstruct(name, [(n, Any, None) for n in names], bases=(base,), kw_only=True)


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a chat message's content (only text is served)."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of a chat request, as the chat template sees it."""

    role: str
    content: str | list[ContentPart] | None = None
    # tool calling: what the chat template sees of an assistant's calls and their results
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _Completion(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False


class _Chat(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Any = None  # services.gateway.tools checks them
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


CompletionBody = _with_unsupported("CompletionBody", _Completion, UNSUPPORTED_COMPLETION)
ChatBody = _with_unsupported("ChatBody", _Chat, UNSUPPORTED_CHAT)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)
_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


@dataclass(slots=True)
class ParsedRequest:
    """What the gateway needs from either endpoint, validated but not yet tokenized."""

    chat: bool
    model: str | None
    prompt_text: str | None = None  # completions with a text prompt
    prompt_ids: list[int] | None = None  # completions with token ids
    messages: list[dict[str, Any]] | None = None  # chat, content flattened to text
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    include_usage: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # the server's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # None: no logprobs; k: the sampled token's and the k most likely, per token.
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt's text (and logprobs) before the answer
    structured: StructuredOutput | None = None
    # chat: (tools, tool_choice, parallel_tool_calls) as sent; the server checks them
    # (services.gateway.tools) and puts the ToolRequest in ``tools``
    tool_fields: tuple[Any, Any, bool | None] = (None, None, None)
    tools: Any = None
    n: int = 1  # sequences (choices) sampled from the prompt

    def sampling(self, max_tokens: int) -> SamplingParams:
        """What goes on the bus; :class:`ApiError` (400) when a value is out of bounds."""
        s = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words_token_ids=self.bad_words_token_ids,
            logprobs=self.logprobs,
            # vLLM: echo with logprobs scores the prompt too (lm-eval's loglikelihood)
            prompt_logprobs=self.logprobs if self.echo else None,
            structured=self.structured,
            n=self.n,
        )
        bad = s.problem()
        if bad is not None:
            name = "max_completion_tokens" if bad[0] == "max_tokens" and self.chat else bad[0]
            raise ApiError(400, bad[1], param=name)
        return s


def _decode(data: bytes, decoder: msgspec.json.Decoder) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg) or _MISSING.search(msg)
        raise ApiError(
            400, f"invalid request body: {msg}", param=m.group(1) if m else None
        ) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec stops at Python's recursion limit (~1000 levels)
        raise ApiError(400, "request body nests too deeply") from None


def _unsupported(body: Any, names: dict[str, Neutral]) -> None:
    for name, neutral in names.items():
        if not neutral(getattr(body, name)):
            raise ApiError(
                400,
                f"`{name}` is not supported by this server: leave it out or send null",
                param=name,
                code="unsupported_parameter",
            )


def _penalty(name: str, v: float | None) -> None:
    if v is None:
        return
    if not -PENALTY_RANGE <= v <= PENALTY_RANGE:
        raise ApiError(400, f"{name} must be in [-2, 2], got {v}", param=name)
    if v != 0:
        raise ApiError(
            400,
            f"{name} other than 0 is not supported by this server",
            param=name,
            code="unsupported_parameter",
        )


def _common(
    body: _Common, parsed: ParsedRequest, vocab_size: int, names: dict[str, Neutral]
) -> None:
    _unsupported(body, names)
    _choices(body, parsed)
    _penalty("presence_penalty", body.presence_penalty)
    _penalty("frequency_penalty", body.frequency_penalty)
    if body.temperature is not None:
        parsed.temperature = body.temperature
    if body.top_p is not None:
        parsed.top_p = body.top_p
    if body.top_k is not None:
        parsed.top_k = body.top_k
    if body.min_p is not None:
        parsed.min_p = body.min_p
    if body.repetition_penalty is not None:
        parsed.repetition_penalty = body.repetition_penalty
    parsed.seed = None if body.seed == -1 else body.seed  # vLLM: -1 is "no seed"
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(
                400, f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop"
            )
        if not all(stops):
            raise ApiError(400, "stop cannot contain an empty string", param="stop")
        parsed.stop = list(stops)
    ids = body.stop_token_ids or ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            400, f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed", param="stop_token_ids"
        )
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"stop token id {t} is out of range", param="stop_token_ids")
    parsed.stop_token_ids = list(ids)
    parsed.ignore_eos = bool(body.ignore_eos)
    _engine_fields(body, parsed, vocab_size)
    # the bounds of every sampling value (max_tokens: the server's, checked later)
    parsed.sampling(max(1, parsed.min_tokens))
    parsed.stream = bool(body.stream)
    if body.stream_options is not None:
        if not parsed.stream:
            raise ApiError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        parsed.include_usage = bool(body.stream_options.include_usage)


def _choices(body: _Common, parsed: ParsedRequest) -> None:
    """``n`` and ``best_of``. vLLM 0.32 has no ``best_of`` (its server ignores the
    field); a value other than ``n`` asks for a ranking this server does not do, so it
    is refused by name rather than silently ignored."""
    n = 1 if body.n is None else body.n
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
    best = body.best_of
    if best is not None and not (type(best) is int and best == n):
        raise ApiError(
            400,
            "`best_of` is not supported by this server (vLLM 0.32 dropped it): leave it "
            "out, or send null or the value of n",
            param="best_of",
            code="unsupported_parameter",
        )
    parsed.n = n


def _engine_fields(body: _Common, parsed: ParsedRequest, vocab_size: int) -> None:
    """vLLM's extensions the engines apply (the bad words are tokenized by the server)."""
    parsed.min_tokens = body.min_tokens or 0
    if body.logit_bias:
        bias = {}
        for k, v in body.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                raise ApiError(
                    400, f"logit_bias key {k!r} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= t < vocab_size:
                raise ApiError(400, f"logit_bias token id {t} is out of range", param="logit_bias")
            if not math.isfinite(v):
                raise ApiError(400, "logit_bias values must be finite", param="logit_bias")
            bias[t] = min(100.0, max(-100.0, v))  # vLLM clamps
        parsed.logit_bias = bias
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise ApiError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
        bad = next((t for t in body.allowed_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"allowed_token_ids has id {bad} out of range", param="allowed_token_ids"
            )
        parsed.allowed_token_ids = list(dict.fromkeys(body.allowed_token_ids))
    if body.bad_words:
        if not all(body.bad_words):
            raise ApiError(400, "bad_words cannot contain an empty string", param="bad_words")
        parsed.bad_words = list(dict.fromkeys(body.bad_words))
    parsed.structured = structured_output(body)
    parsed.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    parsed.skip_special_tokens = body.skip_special_tokens is not False


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(body: _Common) -> StructuredOutput | None:
    """``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` or
    the older ``guided_*`` names, as one constraint; a 400 naming the field otherwise."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format json_schema needs json_schema.schema, a JSON object",
                    param="response_format",
                )
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise ApiError(
                400,
                f"response_format type {kind!r} is not supported: text, json_object or json_schema",
                param="response_format",
                code="unsupported_parameter" if isinstance(kind, str) else None,
            )
    so = body.structured_outputs
    if so is not None:
        extra = sorted(k for k, v in so.items() if k not in STRUCTURED_KEYS and v)
        if extra:
            raise ApiError(
                400,
                f"structured_outputs.{extra[0]} is not supported by this server",
                param="structured_outputs",
                code="unsupported_parameter",
            )
        kinds = {k: so[k] for k in STRUCTURED_KEYS if so.get(k) not in (None, False)}
        if len(kinds) != 1:
            raise ApiError(
                400,
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        found.append(("structured_outputs", kinds))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        v = getattr(body, name)
        if v is not None:
            found.append((name, {key: v}))
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(
            400,
            f"only one structured output constraint is allowed: {found[0][0]} and "
            f"{found[1][0]} are both set",
            param=found[1][0],
        )
    name, (key, value) = found[0][0], next(iter(found[0][1].items()))
    return _constraint(name, key, value)


def _constraint(name: str, key: str, value: Any) -> StructuredOutput:
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ApiError(400, f"{name}: the schema is not valid JSON", param=name) from None
        if not isinstance(value, dict):
            raise ApiError(400, f"{name}: the JSON schema must be an object", param=name)
        return StructuredOutput(json=json.dumps(value))
    if key == "json_object":
        if value is not True:
            raise ApiError(400, f"{name}: json_object must be true", param=name)
        return StructuredOutput(json_object=True)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ApiError(400, f"{name}: choices must be non-empty strings", param=name)
        return StructuredOutput(choice=list(value))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name}: the {key} must be a non-empty string", param=name)
    return StructuredOutput(regex=value) if key == "regex" else StructuredOutput(grammar=value)


def bad_words_token_ids(
    encode: Callable[[str], list[int]], words: list[str], limit: int = MAX_BAD_WORDS
) -> list[list[int]]:
    """vLLM's ``SamplingParams.update_from_tokenizer``: each word as is and with a leading
    space, the second only when it makes a different token sequence of the same length.
    ``encode`` tokenizes without special tokens."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = encode(prefix + word.lstrip())
            if not ids:
                if not prefix:
                    raise ApiError(
                        400,
                        "bad_words entries must tokenize to at least one token",
                        param="bad_words",
                    )
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > limit:
                    raise ApiError(
                        400,
                        f"too many bad words after tokenization: at most {limit}",
                        param="bad_words",
                    )
    return out


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(type(i) is int for i in x)


def parse_completion(data: bytes, vocab_size: int) -> ParsedRequest:
    body: CompletionBody = _decode(data, _completion_decoder)
    parsed = ParsedRequest(chat=False, model=body.model, max_tokens=body.max_tokens)
    parsed.logprobs = body.logprobs
    parsed.echo = bool(body.echo)
    if parsed.echo and body.n not in (None, 1):
        raise ApiError(
            400,
            "echo with n > 1 is not supported by this server",
            param="echo",
            code="unsupported_parameter",
        )
    if parsed.echo and body.stream:
        raise ApiError(
            400,
            "echo with stream=true is not supported by this server",
            param="echo",
            code="unsupported_parameter",
        )
    _common(body, parsed, vocab_size, UNSUPPORTED_COMPLETION)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_ids(prompt):
        prompt = prompt[0]  # ["text"] or [[1, 2, 3]]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        parsed.prompt_text = prompt
    elif _is_ids(prompt) and prompt:
        bad = next((i for i in prompt if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt token id {bad} is out of range [0, {vocab_size})", param="prompt"
            )
        parsed.prompt_ids = prompt
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise ApiError(
            400, "batched prompts are not supported: send one prompt per request", param="prompt"
        )
    else:
        raise ApiError(
            400,
            "prompt must be a string, a non-empty list of token ids, or a one-element list of either",
            param="prompt",
        )
    return parsed


def parse_chat(data: bytes, vocab_size: int, max_messages: int = MAX_MESSAGES) -> ParsedRequest:
    body: ChatBody = _decode(data, _chat_decoder)
    mx = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    parsed = ParsedRequest(chat=True, model=body.model, max_tokens=mx)
    if body.logprobs:
        parsed.logprobs = body.top_logprobs or 0
    elif body.top_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    _common(body, parsed, vocab_size, UNSUPPORTED_CHAT)
    parsed.messages = flatten_messages(body.messages, max_messages)
    parsed.tool_fields = (body.tools, body.tool_choice, body.parallel_tool_calls)
    return parsed


def flatten_messages(messages: list[ChatMessage], max_messages: int) -> list[dict[str, Any]]:
    """Chat messages as the template takes them (text parts joined), or a 400."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if len(messages) > max_messages:
        raise ApiError(
            400,
            f"messages has {len(messages)} entries; this server accepts at most {max_messages}",
            param="messages",
        )
    msgs = []
    for m in messages:
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"unknown message role {m.role!r}", param="messages")
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        400, f"content part type {part.type!r} is not supported", param="messages"
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": text}
        for k in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, k):
                msg[k] = getattr(m, k)
        msgs.append(msg)
    return msgs


# ---------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    use: dict,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        "usage": use,
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    use: dict,
    logprobs: dict | None = None,
    message: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message or {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        ],
        "usage": use,
    }


class ChunkWriter:
    """Builds the SSE ``data:`` lines of one streamed response."""

    __slots__ = ("rid", "created", "model", "chat", "include_usage", "_enc")

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.chat, self.include_usage = chat, include_usage
        self._enc = msgspec.json.Encoder()

    def _frame(self, choices: list, use: dict | None = None, with_usage: bool = False) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = use if with_usage else None
        return b"data: " + self._enc.encode(obj) + b"\n\n"

    def role(self, index: int = 0) -> bytes:
        """Chat only: the first chunk (of choice ``index``), announcing the assistant's role."""
        delta = {"role": "assistant", "content": ""}
        return self._frame(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def text(
        self, text: str, finish: str | None = None, logprobs: dict | None = None, index: int = 0
    ) -> bytes:
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._frame([choice])

    def delta(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        """Chat: one chunk with this ``delta`` (tool calls)."""
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._frame([choice])

    def usage(self, use: dict) -> bytes:
        return self._frame([], use, with_usage=True) if self.include_usage else b""

    def error(self, err: ApiError) -> bytes:
        return b"data: " + self._enc.encode(err.body()) + b"\n\n"

    DONE = b"data: [DONE]\n\n"
