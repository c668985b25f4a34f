"""Stream events -> one HTTP response: a JSON body (:func:`collect`) or SSE (:func:`stream`).

Both consume a request's events through ``next_event()`` (the server's queue reader)
until ``finished`` or ``error``. A stream starts at the first ``tokens`` event, so an
error before it is still a plain HTTP status; after it, an error becomes one SSE chunk
``{"error": {...}}`` and the stream ends without ``[DONE]``. A response that ends while
the backend may still be working (client gone, stop string, the gateway's own verdict)
raises :class:`StopEarly`, and the server sends a CancelRequest.
"""

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import msgspec
from aiohttp import web

from bus_schemas.requests import Accepted, Error, Finished, StreamEvent, Tokens
from services.gateway.logprobs import LogprobsOut
from services.gateway.output import TextOutput
from services.gateway.protocol import (
    ApiError,
    ChunkWriter,
    ParsedRequest,
    chat_response,
    completion_response,
    usage,
)
from services.gateway.replies import LocalError
from services.gateway.tools import ToolOutput

NextEvent = Callable[[], Awaitable[StreamEvent]]

_json = msgspec.json.Encoder()
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass
class RequestOutcome:
    """What happened to one request: for the span, the log line and the metrics."""

    status: int = 200
    finish: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill: str = ""
    decode: str = ""
    ttft_s: float | None = None
    error: str = ""
    max_tokens: int = 0
    # Inter-token latencies: (seconds per token, tokens) for each Tokens event after the
    # first; a gap covering k tokens counts as k tokens of gap/k each.
    itl: list[tuple[float, int]] = field(default_factory=list)
    _last_token_t: float = 0.0

    def note(self, ev: StreamEvent, t0: float, now: float | None = None) -> None:
        if type(ev) is Accepted:
            self.prefill, self.decode = ev.prefill_instance, ev.decode_instance
            self.cached_tokens = ev.cached_tokens
        elif type(ev) is Tokens:
            now = time.perf_counter() if now is None else now
            if self.ttft_s is None:
                self.ttft_s = now - t0
            elif ev.token_ids:
                self.itl.append(((now - self._last_token_t) / len(ev.token_ids), len(ev.token_ids)))
            self._last_token_t = now

    def finished(self, ev: Finished, text: TextOutput) -> None:
        # prompt_tokens stays the gateway's own count (it tokenized the prompt)
        self.finish = ev.finish_reason
        self.completion_tokens = max(ev.completion_tokens, text.completion_tokens)
        self.cached_tokens = ev.cached_tokens


@dataclass
class Extras:
    """What a response carries beside its text: logprobs, and (completions' ``echo``)
    the prompt's text and ids, whose logprobs come with the first token."""

    logprobs: LogprobsOut | None = None
    echo_text: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    tools: ToolOutput | None = None  # chat with tools: the answer becomes tool_calls
    last_ids: Sequence[int] = ()  # the tokens the last push took
    _prompt_done: bool = False

    def push(self, text: TextOutput, ev: Tokens) -> tuple[str, dict | None]:
        """``text.push`` of ``ev``, plus the logprobs of the tokens it took (None when
        none are asked for or none came)."""
        skip = max(0, text.next_index - ev.index)
        before = text.completion_tokens
        delta = text.push(ev.token_ids, ev.index)
        used = text.completion_tokens - before
        self.last_ids = ev.token_ids[skip : skip + used]
        lps = self.logprobs
        if lps is None:
            return delta, None
        part: dict | None = None
        if self.echo_text is not None and ev.prompt_logprobs and not self._prompt_done:
            self._prompt_done = True
            part = lps.add(self.prompt_ids, ev.prompt_logprobs)
        if ev.logprobs and used:
            part = lps.add(ev.token_ids[skip : skip + used], ev.logprobs[skip : skip + used])
        return delta, part


class StopEarly(Exception):
    """The response ends before the backend finished; ``local``: the backend is still at
    work (client gone, stop string, watchdog) and gets a CancelRequest."""

    def __init__(
        self, resp: web.StreamResponse, status: int, reason: str, local: bool = True
    ) -> None:
        super().__init__(reason)
        self.resp, self.status, self.reason, self.local = resp, status, reason, local


class BackendError(ApiError):
    """An Error event as an HTTP error; ``local``: the gateway's own verdict, the backend
    may still hold the request."""

    local: bool = False


_CODES = {
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
    500: "internal_error",
}


def api_error(ev: Error) -> BackendError:
    status = int(ev.code)
    headers: dict[str, str] = {}
    if ev.retry_after_s is not None or status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(ev.retry_after_s or 1)))
    err = BackendError(status, ev.message, code=_CODES.get(status), headers=headers)
    err.local = isinstance(ev, LocalError) and ev.cancel
    return err


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=_json.encode(body), status=status, headers=headers, content_type="application/json"
    )


def error_response(e: ApiError) -> web.Response:
    return json_response(e.body(), e.status, e.headers or None)


async def collect(
    next_event: NextEvent,
    p: ParsedRequest,
    rid: str,
    model: str,
    text: TextOutput,
    out: RequestOutcome,
    extras: Extras | None = None,
) -> web.Response:
    extras = extras or Extras()
    parts: list[str] = [extras.echo_text or ""]
    while True:
        ev = await next_event()
        if isinstance(ev, Tokens):
            parts.append(extras.push(text, ev)[0])
            if text.stopped:
                out.finish, out.completion_tokens = "stop", text.completion_tokens
                break
        elif isinstance(ev, Finished):
            parts.append(text.finish())
            out.finished(ev, text)
            break
        elif isinstance(ev, Error):
            raise api_error(ev)
    use = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
    build = chat_response if p.chat else completion_response
    lps = extras.logprobs.body() if extras.logprobs is not None else None
    answer, finish, message = "".join(parts), out.finish, None
    if extras.tools is not None:
        message, finish = extras.tools.message(answer, finish)
    if message is not None:
        body = chat_response(rid, int(time.time()), model, answer, finish, use, lps, message)
    else:
        body = build(rid, int(time.time()), model, answer, finish, use, lps)
    resp = json_response(body)
    if text.stopped:  # the backend is still generating: tell it to stop
        raise StopEarly(resp, 200, "stop string")
    return resp


async def stream(
    request: web.Request,
    next_event: NextEvent,
    p: ParsedRequest,
    rid: str,
    model: str,
    text: TextOutput,
    out: RequestOutcome,
    write_timeout_s: float,
    extras: Extras | None = None,
) -> web.StreamResponse:
    extras = extras or Extras()
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
            buf = w.role() if p.chat else b""
        tools = extras.tools
        if isinstance(ev, Tokens):
            delta, lps = extras.push(text, ev)
            if tools is not None:
                d = tools.delta(delta, extras.last_ids)
                if d or lps:
                    buf += w.delta(d or {}, logprobs=lps)
            # The first token always gets a chunk, even when its bytes do not yet make
            # a whole character: clients time TTFT by the first chunk.
            elif delta or ev.index == 0 or lps:
                buf += w.text(delta, logprobs=lps)
            if text.stopped:
                out.finish, out.completion_tokens = "stop", text.completion_tokens
        elif isinstance(ev, Finished):
            tail = text.finish()
            if tail and tools is not None:
                d = tools.delta(tail, ())
                buf += w.delta(d) if d else b""
            elif tail:
                buf += w.text(tail)
            out.finished(ev, text)
        if out.finish:
            use = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            finish = out.finish
            if tools is not None:
                last, finish = tools.end(finish)
                buf += w.delta(last) if last else b""
            buf += w.text("", finish=finish) + w.usage(use) + ChunkWriter.DONE
        # The last chunks go out with the stream's end, in one write (one wake of the
        # client's process instead of two).
        end = bool(out.finish)
        if (buf or end) and not await try_write(resp, buf, write_timeout_s, eof=end):
            raise StopEarly(resp, 499, "client disconnected")
        if end:
            if text.stopped:
                raise StopEarly(resp, 200, "stop string")  # cancels the backend
            return resp


class _SseResponse(web.StreamResponse):
    # aiohttp writes a StreamResponse's headers at prepare(): a write, and a wake of the
    # client's process, of their own. Held back (as aiohttp's Response does), they go
    # out with the first chunk, which the caller writes right after.
    _send_headers_immediately = False


async def open_stream(request: web.Request) -> web.StreamResponse:
    """The SSE response, its headers to go out with the first chunk (a client gone
    already stops the request)."""
    resp = _SseResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
    except (ConnectionResetError, OSError):
        raise StopEarly(resp, 499, "client disconnected") from None
    return resp


async def fail_stream(
    resp: web.StreamResponse | None, w: ChunkWriter, ev: Error, write_timeout_s: float
) -> NoReturn:
    """A backend error: an HTTP error before the stream opened, else its last event."""
    err = api_error(ev)
    if resp is None:
        raise err
    await try_write(resp, w.error(err), write_timeout_s)
    await try_eof(resp)
    raise StopEarly(resp, err.status, err.message, local=err.local)


async def try_write(
    resp: web.StreamResponse, data: bytes, timeout: float, eof: bool = False
) -> bool:
    """False when the client is gone (or has not read anything for ``timeout`` s);
    ``eof``: ``data`` ends the response."""
    try:
        async with asyncio.timeout(timeout):
            if eof:
                await resp.write_eof(data)
            else:
                await resp.write(data)
        return True
    except (ConnectionResetError, OSError, RuntimeError, TimeoutError):
        return False


async def try_eof(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except (ConnectionResetError, OSError, RuntimeError):
        pass
