"""OpenAI request bodies in, OpenAI response bodies out: pure functions, no I/O.

Request bodies decode with msgspec into typed structs that ignore unknown fields, as
OpenAI does; a wrong type or a malformed body raises :class:`ApiError` (HTTP 400 with
OpenAI's ``{"error": {message, type, param, code}}``). Extensions: ``ignore_eos`` and
``stop_token_ids`` (vLLM's names).
"""

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

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
    include_usage: bool | None = False


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
    user: str | None = None
    # extensions
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


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
    messages: list[dict[str, str]] | None = None  # chat, content flattened to text
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False


def _decode(data: bytes, decoder: msgspec.json.Decoder) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg) or _MISSING.search(msg)
        raise ApiError(400, f"invalid request body: {msg}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def _common(body: _Common, parsed: ParsedRequest, vocab_size: int) -> None:
    if body.n is not None and body.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.temperature is not None:
        if not 0.0 <= body.temperature <= 2.0:
            raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
        parsed.temperature = body.temperature
    if body.top_p is not None:
        if not 0.0 < body.top_p <= 1.0:
            raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
        parsed.top_p = body.top_p
    parsed.seed = body.seed
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        parsed.stop = [s for s in stops if s]
    for t in body.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"stop token id {t} is out of range", param="stop_token_ids")
    parsed.stop_token_ids = list(body.stop_token_ids or ())
    parsed.ignore_eos = bool(body.ignore_eos)
    parsed.stream = bool(body.stream)
    if body.stream_options is not None:
        if not parsed.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        parsed.include_usage = bool(body.stream_options.include_usage)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(type(i) is int for i in x)


def parse_completion(data: bytes, vocab_size: int) -> ParsedRequest:
    body: CompletionBody = _decode(data, _completion_decoder)
    parsed = ParsedRequest(chat=False, model=body.model, max_tokens=body.max_tokens)
    _common(body, parsed, vocab_size)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_ids(prompt):
        prompt = prompt[0]  # ["text"] or [[1, 2, 3]]
    if isinstance(prompt, str):
        parsed.prompt_text = prompt
    elif _is_ids(prompt) and prompt:
        bad = next((i for i in prompt if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is out of range [0, {vocab_size})", param="prompt")
        parsed.prompt_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    else:
        raise ApiError(
            400, "prompt must be a string, a non-empty list of token ids, or a one-element list of either",
            param="prompt",
        )
    return parsed


def parse_chat(data: bytes, vocab_size: int) -> ParsedRequest:
    body: ChatBody = _decode(data, _chat_decoder)
    mx = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    parsed = ParsedRequest(chat=True, model=body.model, max_tokens=mx)
    _common(body, parsed, vocab_size)
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    msgs = []
    for m in body.messages:
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"unknown message role {m.role!r}", param="messages")
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"content part type {part.type!r} is not supported", param="messages")
                texts.append(part.text)
            text = "\n".join(texts)
        msgs.append({"role": m.role, "content": text})
    parsed.messages = msgs
    return parsed


# ---------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": use,
    }


def chat_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
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

    def role(self) -> bytes:
        """Chat only: the first chunk, announcing the assistant's role."""
        delta = {"role": "assistant", "content": ""}
        return self._frame([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def text(self, text: str, finish: str | None = None) -> bytes:
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._frame([choice])

    def usage(self, use: dict) -> bytes:
        return self._frame([], use, with_usage=True) if self.include_usage else b""

    def error(self, err: ApiError) -> bytes:
        return b"data: " + self._enc.encode(err.body()) + b"\n\n"

    DONE = b"data: [DONE]\n\n"
