"""The HTTP front of perigee: OpenAI-compatible endpoints over the NATS request path.

Lifecycle of one request (``/v1/completions``, ``/v1/chat/completions``):

    CONNECT   at most --max-connections open, the rest get 503 and are closed; the
              headers within --header-timeout, or the connection is closed
              (:mod:`services.gateway.connections`)
    READ      body, at most --max-body-bytes (413), within --body-timeout (408)
    ADMIT     at most --max-inflight requests at once, the rest   (429 + Retry-After)
              (a request counts once its body is in: slow uploads lock no one out)
    PARSE     OpenAI body -> ParsedRequest, model name, sampling bounds (400 / 404)
    TOKENIZE  prompt -> ids (off the event loop when long; a chat's template always);
              a message's special-token strings are text (:meth:`Tokenizer.encode_chat`);
              limits (400)
    PUBLISH   GenerateRequest on perigee.requests, reply = perigee.gw.<gateway>.<rid>;
              the reply queue is open before the publish
    WAIT      Accepted (instances noted) ... first Tokens: a stream starts here, so any
              error before the first token is a plain HTTP status (429 + Retry-After,
              503, 500, 504); after it, an SSE error chunk ends the stream
    DONE      Finished -> usage, finish_reason; [DONE]
Client disconnect, a watchdog verdict or a stop string publishes CancelRequest. A
verdict that the request's prefill or decode instance died resends it instead, with
the tokens the client already has, up to ``migration_limit`` times
(:mod:`services.gateway.resend`, :mod:`services.gateway.replies`): the stream goes on.
Responses are built in :mod:`services.gateway.responses`; spans, metrics and the log
line in :mod:`services.gateway.telemetry`; API keys (``api_keys``) are checked by
:mod:`services.gateway.auth` before any of this (401). ``/metrics`` is Prometheus
(:mod:`services.common.metrics`), ``/health`` is always open.
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS
from opentelemetry import trace

from bus_schemas.requests import (
    GenerateRequest,
    SamplingParams,
    StreamEvent,
    StructuredOutput,
    Tokens,
)
from services.common import bus, defaults, intake_queue, metrics
from services.common.bus import PayloadTooLarge
from services.common.clock import Clock, WallClock
from services.common.hashing import block_hashes
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.common.tokenizer import Tokenizer
from services.gateway import auth, choices, connections, telemetry, tools
from services.gateway.logprobs import LogprobsOut
from services.gateway.output import TextOutput
from services.gateway.protocol import (
    MAX_MESSAGES,
    ApiError,
    ParsedRequest,
    bad_words_token_ids,
    parse_chat,
    parse_completion,
)
from services.gateway.replies import LocalError, ReplyRouter
from services.gateway.responses import (
    BackendError,
    Extras,
    RequestOutcome,
    StopEarly,
    collect,
    error_response,
    json_response,
    stream,
)
from services.gateway.telemetry import request_attributes
from services.gateway.tokenize import detokenize as detokenize_body
from services.gateway.tokenize import tokenize as tokenize_body
from services.gateway.watchdog import Watchdog
from tracing import tracer

log = structlog.get_logger()
OFFLOOP_CHARS = 4096  # tokenize longer prompts in a thread (the Rust encoder drops the GIL)
OFFLOOP_MESSAGES = 16  # render a chat of more messages (or of longer text) in a thread
LISTEN_BACKLOG = (
    4096  # a burst of clients connecting at once waits in the kernel, not in SYN retries
)


@dataclass
class GatewayConfig:
    """The gateway's settings: its address, model, limits and timeouts."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: str | None = None
    served_model_name: str = "tiny-llama"
    block_size: int = defaults.BLOCK_SIZE
    max_prompt_tokens: int = 8192
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 120.0
    dead_after_s: float = defaults.DEAD_AFTER_S
    # A request with no progress for wedge_factor x its prediction + wedge_floor_s, on an
    # instance that still reports load, counts as wedged there (services.gateway.watchdog).
    wedge_factor: float = 10.0
    wedge_floor_s: float = 10.0
    max_model_len: int | None = None  # None: config.json's max_position_embeddings
    default_max_tokens: int = 16  # completions; chat defaults to what the context allows
    sweep_interval_s: float | None = None  # None: derived; 0: no sweeper (tests sweep by hand)
    gateway_id: str = ""
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # Generation requests handled at once (body read to last byte); the next gets 429.
    # Each holds a socket, a reply queue and its detokenizer: this bounds the memory.
    max_inflight: int = 1024
    # Times a request whose prefill or decode instance died is resent with the tokens
    # it has (services.gateway.resend); 0: such a request fails with 503.
    migration_limit: int = 3
    # A migration that finds no live instance of the dead one's role waits this long for
    # one (the restart of the only one: a vLLM engine takes tens of seconds) before 503.
    migration_wait_s: float = 60.0
    # Publish requests on the crash-safe INTAKE work queue (services.common.intake_queue)
    # rather than core NATS REQUESTS (False, the default: the core path; what a dead
    # admission or conductor held is resent, services.gateway.control_presence).
    durable_intake: bool = False
    # The stack's SLOs, s: the gateway does not enforce them (admission and the conductor
    # do), it tells clients what it is graded on (GET /v1/perigee/config; perigee replay).
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    intake_patience_s: float = intake_queue.PATIENCE_S  # then the core path (0: wait)
    # Slow clients (services.gateway.connections): connections open at once (the next
    # gets 503 and is closed), seconds for a request's headers (from the connection's
    # start or the request's first byte) and for its body (from its headers, then 408),
    # and an idle kept-alive connection's life (longer than a proxy's 60 s).
    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    # Chat messages in one request (400 past it): the template renders each of them.
    max_messages: int = MAX_MESSAGES
    # True: a special token's string in a message becomes that token (vLLM's way);
    # False: it is text, as in OpenAI's API (Tokenizer.encode_chat).
    content_special_tokens: bool = False
    # vLLM's tool parser for tool_choice "auto" (--tool-call-parser); None: auto refused.
    tool_call_parser: str | None = None
    # A new request gets 429 while a request waiting for its first token is overdue by
    # more than this: unplaced, since it was sent; placed, since the conductor's TTFT
    # estimate (the stack is behind its own promises: services.gateway.lateness); or
    # while as many wait as the cap that late first tokens set; 0: never. Off by
    # default: a restarting admission also leaves requests waiting (the durable intake
    # keeps them), and those should not turn the next requests away.
    max_lateness_s: float = 0.0
    # The same 429s, judged by what no engine's pace moves: four requests unplaced for
    # longer than this (a backlog: lateness.BACKLOG), or as many waiting as the cap
    # that first tokens with more control-plane overhead than this set (their wait
    # less the engine's part, Tokens.engine_s); 0: never. On by default: a control
    # plane behind answers 429 (perigee up turns it off beside vLLM on CPU, whose
    # compute holds the control plane's cores: perigee.stack.Stack._gate_env).
    max_overhead_s: float = 0.02


class Gateway:
    """The OpenAI-compatible HTTP server that turns requests into bus requests and streams."""

    def __init__(
        self,
        cfg: GatewayConfig,
        nc: NATS,
        tokenizer: Tokenizer | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self.nc = nc
        self.tok = tokenizer or Tokenizer.from_dir(cfg.model_dir)
        spec = ModelSpec.from_dir(cfg.model_dir)
        self.max_model_len = cfg.max_model_len or spec.max_model_len
        # The engines stop on config.json's EOS; a chat model may declare more (the
        # tokenizer's, generation_config.json's): those ride as stop token ids.
        eos = [*spec.eos_token_ids, *([self.tok.eos_id] if self.tok.eos_id is not None else [])]
        self.extra_eos = tuple(dict.fromkeys(i for i in eos if i != spec.eos_token_id))
        self.gateway_id = cfg.gateway_id or uuid.uuid4().hex[:12]
        self.watchdog = Watchdog(
            clock or WallClock(),
            cfg.dead_after_s,
            cfg.request_timeout_s,
            wedge_factor=cfg.wedge_factor,
            wedge_floor_s=cfg.wedge_floor_s,
        )
        if cfg.migration_limit < 0:
            raise ValueError("migration_limit must be at least 0")
        self.router = ReplyRouter(
            nc,
            self.gateway_id,
            self.watchdog,
            cfg.migration_limit,
            eos_token_ids=(*spec.eos_token_ids, *self.extra_eos),
        )
        self.router.durable_intake = cfg.durable_intake
        self.router.migration_wait_s = cfg.migration_wait_s
        self.router.intake_patience_s = cfg.intake_patience_s
        self.router.lateness.limit_s = cfg.max_lateness_s
        self.router.lateness.overhead_s = cfg.max_overhead_s
        # Real-time backstop behind the watchdog (whose clock may be a test's).
        self._guard_s = cfg.request_timeout_s + cfg.dead_after_s + 5.0
        self._created = int(time.time())
        self._served = False  # the stack was ready once: /v1/models answers from then on
        self._bg: set[asyncio.Task] = set()
        if cfg.max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.inflight = 0  # generation requests from their body's end to their response's
        self.reading = 0  # generation requests whose body is being read
        if cfg.body_timeout_s <= 0 or cfg.keepalive_timeout_s <= 0:
            raise ValueError("body_timeout_s and keepalive_timeout_s must be positive")
        if cfg.max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        self.guard = connections.ConnectionGuard(cfg.max_connections, cfg.header_timeout_s)
        self._tool_parser: tuple[Any, Any] | None = None  # (vLLM parser class, tokenizer)
        if cfg.tool_call_parser:
            self._tool_parser = tools.load_parser(
                cfg.tool_call_parser, str(cfg.model_dir or DEFAULT_MODEL_DIR)
            )
        metrics.setup("gateway", *connections.COLLECTORS, span_metrics=False)
        metrics.IN_FLIGHT.set_function(lambda: self.inflight)
        metrics.MAX_INFLIGHT.set(cfg.max_inflight)
        model = cfg.served_model_name
        self.app = web.Application(
            client_max_size=cfg.max_body_bytes + 1,
            middlewares=[
                connections.ConnectionGuard.middleware,
                auth.middleware(tuple(cfg.api_keys), lambda st: telemetry.rejected(model, st)),
            ],
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/v1/perigee/config", self.config),
                web.get("/health", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", metrics.metrics_handler),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.port: int = cfg.port

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> "Gateway":
        interval = self.cfg.sweep_interval_s
        if interval is None:
            interval = min(
                max(min(self.cfg.dead_after_s, self.cfg.request_timeout_s) / 4, 0.05), 1.0
            )
        await self.router.start(interval)
        handler_kwargs = {"access_log": None, "keepalive_timeout": self.cfg.keepalive_timeout_s}
        self._runner = web.AppRunner(self.app, handler_cancellation=True, **handler_kwargs)
        await self._runner.setup()
        site = connections.GuardedSite(
            self._runner,
            self.cfg.host,
            self.cfg.port,
            self.guard,
            handler_kwargs,
            backlog=LISTEN_BACKLOG,
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("gateway_started", host=self.cfg.host, port=self.port, gateway_id=self.gateway_id)
        return self

    async def stop(self) -> None:
        await self.close()

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, give in-flight requests ``grace_s`` to finish, fail the rest
        with 503 (their backends get a CancelRequest), then shut down."""
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
            if not await self.router.wait_idle(grace_s):
                log.warning("shutdown_failing_requests", in_flight=self.router.in_flight)
                self.router.fail_all(503, "the gateway is shutting down")
                await self.router.wait_idle(5.0)
            await self._runner.cleanup()
            self._runner = None
        await self.router.close()
        if self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- small endpoints -----------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        # vLLM lists its model only once it serves (it listens after its engine starts),
        # so clients poll this to wait: it answers 503 until the stack was ready once.
        if not self._served:
            missing = self.router.missing()
            if missing:
                return error_response(
                    ApiError(
                        503,
                        f"the stack is starting: no {', no '.join(missing)} yet",
                        code="service_unavailable",
                        headers={"Retry-After": "1"},
                    )
                )
            self._served = True
        card = {
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "perigee",
            "root": self.cfg.served_model_name,
            "max_model_len": self.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (:mod:`services.gateway.tokenize`)."""
        c = self.cfg
        return await self._tokenizer_call(
            request,
            lambda data: tokenize_body(
                data, self.tok, self.max_model_len, c.max_messages, c.content_special_tokens
            ),
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``."""
        return await self._tokenizer_call(request, lambda data: detokenize_body(data, self.tok))

    async def _tokenizer_call(self, request: web.Request, run) -> web.Response:
        try:
            model, body = run(await self._read_body(request))
            self._check_model(model)
        except ApiError as e:
            return self._rejected(e)
        return json_response(body)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.served_model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist; this server serves "
                f"`{self.cfg.served_model_name}` (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def config(self, request: web.Request) -> web.Response:
        """The effective configuration a client may grade itself against."""
        c = self.cfg
        return json_response(
            {
                "model": c.served_model_name,
                "max_model_len": self.max_model_len,
                "block_size": c.block_size,
                "ttft_slo_s": c.ttft_slo_s,
                "tbt_slo_s": c.tbt_slo_s,
                "max_tokens_limit": c.max_tokens_limit,
                "max_prompt_tokens": c.max_prompt_tokens,
                "migration_limit": c.migration_limit,
                "durable_intake": c.durable_intake,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        ok = self.nc.is_connected
        body = {
            "status": "ok" if ok else "unavailable",
            "gateway_id": self.gateway_id,
            "in_flight": self.router.in_flight,
            "live_instances": len(self.watchdog.liveness.alive_instances()),
        }
        return json_response(body, 200 if ok else 503)

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness (``/health`` is liveness): 200 while an admission and a conductor
        beat and a prefill and a decode instance report load, so a load balancer sends
        no request that could only get a 503."""
        missing = self.router.missing()
        if not missing:
            self._served = True
        body = {"ready": not missing, "gateway_id": self.gateway_id, "missing": missing}
        return json_response(body, 503 if missing else 200)

    # ---- generation ----------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        too_big = ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_big
        chunks, n = [], 0
        self.reading += 1
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for chunk in request.content.iter_any():
                    n += len(chunk)
                    if n > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            connections.SLOW.labels("body").inc()
            raise ApiError(
                408,
                f"the request body did not arrive within {self.cfg.body_timeout_s:g} s",
                code="request_timeout",
            ) from None
        finally:
            self.reading -= 1
        return b"".join(chunks)

    def _encode_chat(self, messages: list[dict[str, Any]], tool_list: Any = None) -> list[int]:
        try:
            return self.tok.encode_chat(
                messages, content_specials=self.cfg.content_special_tokens, tools=tool_list
            )
        except Exception as e:  # noqa: BLE001 - the model's template refused the messages
            raise ApiError(
                400, f"the chat template cannot render these messages: {e}", param="messages"
            ) from None

    async def _tokenize(self, p: ParsedRequest) -> list[int]:
        if p.prompt_ids is not None:
            return p.prompt_ids
        if p.chat:
            tool_list = p.tools.tools if p.tools is not None else None
            # The template is Python (jinja2): a long chat would hold the loop and every
            # stream on it, so it renders, and the text encodes, in a thread. A short
            # one takes less time than the hop (~0.15 ms) and stays.
            msgs = p.messages or []
            if len(msgs) <= OFFLOOP_MESSAGES and sum(len(m["content"]) for m in msgs) <= (
                OFFLOOP_CHARS
            ):
                return self._encode_chat(msgs, tool_list)
            return await asyncio.to_thread(self._encode_chat, msgs, tool_list)
        text, add_bos = p.prompt_text or "", True
        if len(text) <= OFFLOOP_CHARS:
            return self.tok.encode(text, add_bos=add_bos)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.tok.encode, text, add_bos)

    def _max_tokens(self, p: ParsedRequest, n: int) -> int:
        cfg, where = self.cfg, "messages" if p.chat else "prompt"
        if n > cfg.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {n} tokens; this server accepts at most {cfg.max_prompt_tokens}",
                param=where,
                code="context_length_exceeded",
            )
        mt = p.max_tokens
        name = "max_completion_tokens" if p.chat else "max_tokens"
        if mt is None:
            mt = (
                min(cfg.max_tokens_limit, self.max_model_len - n)
                if p.chat
                else cfg.default_max_tokens
            )
        if mt < 1 and p.max_tokens is not None:
            raise ApiError(400, f"{name} must be at least 1", param=name)
        if mt > cfg.max_tokens_limit:
            raise ApiError(
                400,
                f"{name} is {mt}; this server allows at most {cfg.max_tokens_limit}",
                param=name,
            )
        if mt < 1 or n + mt > self.max_model_len:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {n} prompt tokens and asks for {max(mt, 1)} more",
                param=where,
                code="context_length_exceeded",
            )
        return mt

    def _stop_on_eos(self, s: SamplingParams) -> SamplingParams:
        if s.ignore_eos or not self.extra_eos:
            return s
        extra = [i for i in self.extra_eos if i not in s.stop_token_ids]
        return msgspec.structs.replace(s, stop_token_ids=[*s.stop_token_ids, *extra])

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            data = await self._read_body(request)
        except ApiError as e:
            resp = self._rejected(e)
            if e.status == 408:  # close at once: no lingering read of what else trickles in
                resp.force_close()
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
            return resp
        if self.inflight >= self.cfg.max_inflight:
            return self._turned_away(
                metrics.INFLIGHT_REJECTIONS,
                f"the gateway is serving its limit of {self.cfg.max_inflight} requests",
            )
        lateness, now = self.router.lateness, self.watchdog.clock.now()
        limit = self.cfg.max_lateness_s or self.cfg.max_overhead_s
        if limit and (late := lateness.overdue(now)) > limit:
            return self._turned_away(
                metrics.LATENESS_REJECTIONS,
                f"the stack is behind: first tokens are {late * 1e3:.0f} ms overdue "
                f"(limit {limit * 1e3:.0f} ms)",
            )
        if lateness.capping:  # both gates off: no per-request work for it
            full = lateness.full(now)  # (which may lift the cap: the gauge follows)
            metrics.WAIT_CAP.set(lateness.cap)
            if full:
                return self._turned_away(
                    metrics.LATENESS_REJECTIONS,
                    f"the stack is behind: {lateness.counted} requests wait for their first "
                    f"token, as many as it kept on time lately",
                )
        self.inflight += 1
        try:
            return await self._admitted(request, data, chat, t0)
        finally:
            self.inflight -= 1

    def _turned_away(self, counter: Any, why: str) -> web.Response:
        """429 + Retry-After before the request is accepted (gateway overload)."""
        counter.inc()
        telemetry.rejected(self.cfg.served_model_name, 429)
        return error_response(
            ApiError(
                429,
                f"{why}; retry shortly",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        )

    def _rejected(self, e: ApiError) -> web.Response:
        telemetry.rejected(self.cfg.served_model_name, e.status)
        log.info("request_rejected", status=e.status, error=e.message, param=e.param)
        return error_response(e)

    async def _admitted(
        self, request: web.Request, data: bytes, chat: bool, t0: float
    ) -> web.StreamResponse:
        try:
            p = (
                parse_chat(data, self.tok.vocab_size, self.cfg.max_messages)
                if chat
                else parse_completion(data, self.tok.vocab_size)
            )
            self._check_model(p.model)
            if p.chat:
                self._tools(p, data)
            ids = await self._tokenize(p)
            if p.bad_words:  # the engines load no tokenizer: they get the ids
                p.bad_words_token_ids = bad_words_token_ids(
                    lambda w: self.tok.encode(w, add_bos=False), p.bad_words
                )
            max_tokens = self._max_tokens(p, len(ids))
            sampling = self._stop_on_eos(p.sampling(max_tokens))
        except ApiError as e:
            return self._rejected(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        attrs = request_attributes(
            chat=chat,
            model=self.cfg.served_model_name,
            max_tokens=max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop=p.stop,
            request_id=rid,
            prompt_tokens=len(ids),
        )
        with (
            structlog.contextvars.bound_contextvars(request_id=rid),
            tracer().start_as_current_span(
                "gateway.request", kind=trace.SpanKind.SERVER, attributes=attrs
            ) as span,
        ):
            out = RequestOutcome(prompt_tokens=len(ids), max_tokens=max_tokens)
            try:
                return await self._run(request, p, ids, sampling, rid, out, t0)
            finally:
                telemetry.finish(span, out, t0, self.cfg.served_model_name)

    async def _run(
        self,
        request: web.Request,
        p: ParsedRequest,
        ids: list[int],
        sampling: SamplingParams,
        rid: str,
        out: RequestOutcome,
        t0: float,
    ) -> web.StreamResponse:
        bs = self.cfg.block_size
        gen = GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=sampling,
            block_size=bs,
            block_hashes=block_hashes(ids, bs),
            model=self.cfg.served_model_name,
            arrival_ts=time.time(),
            reply_subject=self.router.reply_subject(rid),
            finish_with_tokens=True,
        )
        q = self.router.open(rid)
        cancel_reason = ""  # set when the backend may still be working and must be told
        try:
            try:
                await self.router.send(gen)
            except PayloadTooLarge as e:
                raise ApiError(
                    413, f"request too large for the message bus: {e}", code="request_too_large"
                ) from None
            except Exception as e:  # noqa: BLE001 - NATS down or closing
                raise ApiError(
                    503, f"message bus unavailable: {e}", code="service_unavailable"
                ) from None
            # Out on the bus first (it is written once this task waits): what only the
            # answer needs is made while the request travels.
            await bus.flush_soon()
            text = self._text_output(p, sampling)
            extras = self._extras(p, ids)
            model = self.cfg.served_model_name

            span = trace.get_current_span()

            async def next_event() -> StreamEvent:
                ev = await self._next(q, rid)
                if out.ttft_s is None and isinstance(ev, Tokens):
                    span.add_event("first_token")
                out.note(ev, t0)
                return ev

            if p.n > 1:
                many = choices.make_choices(
                    p.n, lambda: self._text_output(p, sampling), lambda: self._extras(p, ids)
                )
                if p.stream:
                    return await choices.stream_n(
                        request, next_event, p, rid, model, many, out, self._guard_s
                    )
                return await choices.collect_n(next_event, p, rid, model, many, out)
            if p.stream:
                return await stream(
                    request, next_event, p, rid, model, text, out, self._guard_s, extras
                )
            return await collect(next_event, p, rid, model, text, out, extras)
        except ApiError as e:
            out.status, out.error = e.status, e.message
            if isinstance(e, BackendError) and e.local:
                cancel_reason = e.message
            return error_response(e)
        except StopEarly as e:
            out.status = e.status
            out.error = e.reason if e.status >= 400 else ""
            if e.local:
                cancel_reason = e.reason
            return e.resp
        except asyncio.CancelledError:
            out.status, out.error = 499, "client disconnected"
            cancel_reason = out.error
            raise
        finally:
            current = self.router.current_attempt(rid)  # a migrated request has a new id
            holders = self.router.placement(rid)
            self.router.close_request(rid)
            if cancel_reason:
                self._spawn(self.router.cancel(current, cancel_reason, holders))

    def _text_output(self, p: ParsedRequest, sampling: SamplingParams) -> TextOutput:
        return TextOutput(
            self.tok.detokenizer(p.skip_special_tokens),
            p.stop,
            p.include_stop_str_in_output,
            self._hidden(sampling, p.include_stop_str_in_output),
        )

    def _tools(self, p: ParsedRequest, data: bytes) -> None:
        """A chat's tools (services.gateway.tools): named or required constrain the
        answer by their JSON schema (over any other structured output, as vLLM does)."""
        parser = self.cfg.tool_call_parser
        tr = tools.parse_tools(*p.tool_fields, parser)
        if tr is None:
            return
        p.tools = tr
        schema = tr.schema()
        if schema is not None:
            p.structured = StructuredOutput(json=json.dumps(schema))
        if tr.choice == "none":
            return
        if p.n > 1:
            raise ApiError(
                400,
                "tools with n > 1 are not supported by this server (tool_choice none is)",
                param="n",
                code="unsupported_parameter",
            )
        if tr.choice != "auto" or self._tool_parser is None:
            tr.output = tools.ToolOutput(tr)
            return
        cls, tok = self._tool_parser
        try:  # vLLM's parser reads vLLM's request object
            req = tools.vllm_request(json.loads(data))
            parser = cls(tok, req.tools)
            req = parser.adjust_request(req)
        except Exception as e:  # noqa: BLE001 - vLLM's own validation of the body
            raise ApiError(
                400, f"the tool parser refused the request: {e}", param="tools"
            ) from None
        p.skip_special_tokens = req.skip_special_tokens  # hermes keeps its markup tokens
        tr.output = tools.ToolOutput(tr, parser, req)

    def _hidden(self, s: SamplingParams, include_stop: bool) -> frozenset[int]:
        """The tokens that end an answer: left out of its text, as vLLM does."""
        if include_stop:
            return frozenset()
        eos = () if s.ignore_eos else self.router.eos_token_ids
        return frozenset((*s.stop_token_ids, *eos))

    def _extras(self, p: ParsedRequest, ids: list[int]) -> Extras:
        lps = None
        if p.logprobs is not None:
            tok = self.tok
            lps = LogprobsOut(
                lambda t: tok.decode((t,), skip_special_tokens=False), p.chat, p.logprobs
            )
        echo = None
        if p.echo:  # vLLM: the prompt as sent, or its ids decoded
            echo = p.prompt_text if p.prompt_text is not None else self.tok.decode(ids, False)
        out = p.tools.output if p.tools is not None else None
        return Extras(logprobs=lps, echo_text=echo, prompt_ids=ids, tools=out)

    async def _next(self, q: asyncio.Queue, rid: str) -> StreamEvent:
        if not q.empty():
            return q.get_nowait()
        try:
            async with asyncio.timeout(self._guard_s):
                return await q.get()
        except TimeoutError:
            return LocalError(
                request_id=rid, code=504, message="no response from the serving backend"
            )
