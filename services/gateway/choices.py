"""Stream events of a request with ``n`` > 1 -> one response with ``n`` choices.

The decode instance runs the n sequences of one prompt (services.decode.worker); their
Tokens carry ``seq`` (the choice's index) and an index within the sequence, and one
Finished ends them all, with each sequence's finish reason and token count. Each choice
has its own detokenizer, stop strings and logprobs; a choice that hits a stop string
ends there (its later tokens are dropped), and the response ends once every choice has
ended. usage counts the completion tokens of every choice, as vLLM's does.

Like :mod:`services.gateway.responses` (whose errors and StopEarly this reuses): an
error before the first token is a plain HTTP status, after it an SSE error chunk.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from bus_schemas.requests import Accepted, Error, Finished, Tokens
from services.gateway.output import TextOutput
from services.gateway.protocol import ChunkWriter, ParsedRequest, usage
from services.gateway.responses import (
    Extras,
    NextEvent,
    RequestOutcome,
    StopEarly,
    api_error,
    fail_stream,
    json_response,
    open_stream,
    try_write,
)


@dataclass
class Choice:
    """One of the n answers being assembled."""

    index: int
    text: TextOutput
    extras: Extras
    parts: list[str] = field(default_factory=list)
    finish: str = ""  # set once this choice has ended
    lps: list[dict] = field(default_factory=list)

    def tokens(self) -> int:
        return self.text.completion_tokens


def make_choices(
    n: int, text: Callable[[], TextOutput], extras: Callable[[], Extras]
) -> list[Choice]:
    return [Choice(i, text(), extras()) for i in range(n)]


def _push(c: Choice, ev: Tokens) -> tuple[str, dict | None]:
    delta, lps = c.extras.push(c.text, ev)
    if c.text.stopped:
        c.finish = "stop"
    return delta, lps


def _finish_all(choices: list[Choice], ev: Finished) -> list[tuple[Choice, str]]:
    """End every choice still open with ``ev``; returns (choice, its held-back text)."""
    tails = []
    for c in choices:
        if c.finish:
            continue
        tails.append((c, c.text.finish()))
        i = c.index
        c.finish = ev.seq_finish[i] if i < len(ev.seq_finish) else ev.finish_reason
        if i < len(ev.seq_tokens):
            # the engine's count, when a stop token it did not send is in it
            c.text.completion_tokens = max(c.text.completion_tokens, ev.seq_tokens[i])
    return tails


def _settle(out: RequestOutcome, choices: list[Choice], ev: Finished | None) -> dict:
    out.finish = choices[0].finish
    out.completion_tokens = sum(c.tokens() for c in choices)
    if ev is not None:
        out.cached_tokens = ev.cached_tokens
    return usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


def _seq(choices: list[Choice], ev: Tokens) -> Choice | None:
    """The open choice ``ev`` belongs to (None: ended already, or no such choice)."""
    c = choices[ev.seq] if 0 <= ev.seq < len(choices) else None
    return None if c is None or c.finish else c


async def collect_n(
    next_event: NextEvent,
    p: ParsedRequest,
    rid: str,
    model: str,
    choices: list[Choice],
    out: RequestOutcome,
) -> web.Response:
    last: Finished | None = None
    while not all(c.finish for c in choices):
        ev = await next_event()
        if isinstance(ev, Tokens):
            c = _seq(choices, ev)
            if c is not None:
                c.parts.append(_push(c, ev)[0])
        elif isinstance(ev, Finished):
            last = ev
            for c, tail in _finish_all(choices, ev):
                c.parts.append(tail)
        elif isinstance(ev, Error):
            raise api_error(ev)
    use = _settle(out, choices, last)
    body = {
        "id": rid,
        "object": "chat.completion" if p.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice_body(p, c) for c in choices],
        "usage": use,
    }
    resp = json_response(body)
    if last is None:  # every choice ended on a stop string: the backend still generates
        raise StopEarly(resp, 200, "stop string")
    return resp


def _choice_body(p: ParsedRequest, c: Choice) -> dict:
    text = "".join(c.parts)
    lps = c.extras.logprobs.body() if c.extras.logprobs is not None else None
    if p.chat:
        message = {"role": "assistant", "content": text}
        return {"index": c.index, "message": message, "logprobs": lps, "finish_reason": c.finish}
    return {"index": c.index, "text": text, "logprobs": lps, "finish_reason": c.finish}


async def stream_n(
    request: web.Request,
    next_event: NextEvent,
    p: ParsedRequest,
    rid: str,
    model: str,
    choices: list[Choice],
    out: RequestOutcome,
    write_timeout_s: float,
) -> web.StreamResponse:
    w = ChunkWriter(rid, int(time.time()), model, p.chat, p.include_usage)
    resp: web.StreamResponse | None = None
    while True:
        ev = await next_event()
        if isinstance(ev, Accepted):
            continue
        if isinstance(ev, Error):
            await fail_stream(resp, w, ev, write_timeout_s)
        buf = b""
        if resp is None:
            resp = await open_stream(request)
            if p.chat:
                buf = b"".join(w.role(c.index) for c in choices)
        last: Finished | None = None
        if isinstance(ev, Tokens):
            c = _seq(choices, ev)
            if c is not None:
                delta, lps = _push(c, ev)
                # A choice's first token always gets a chunk (clients time it).
                if delta or ev.index == 0 or lps:
                    buf += w.text(delta, logprobs=lps, index=c.index)
                if c.finish:
                    buf += w.text("", finish=c.finish, index=c.index)
        elif isinstance(ev, Finished):
            last = ev
            for c, tail in _finish_all(choices, ev):
                buf += w.text(tail, finish=c.finish, index=c.index)
        done = all(c.finish for c in choices)
        if done:
            buf += w.usage(_settle(out, choices, last)) + ChunkWriter.DONE
        if (buf or done) and not await try_write(resp, buf, write_timeout_s, eof=done):
            raise StopEarly(resp, 499, "client disconnected")
        if done:
            if last is None:
                raise StopEarly(resp, 200, "stop string")  # cancels the backend
            return resp
