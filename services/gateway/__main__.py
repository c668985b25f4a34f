"""``python -m services.gateway --nats URL --port 8000 --model-dir models/tiny-llama ...``

Prometheus metrics are on the gateway's own port (``/metrics``). ``--api-key`` (repeat
it, or a comma list; also ``PERIGEE_API_KEY``) makes every route but ``/health`` and
``/metrics`` require ``Authorization: Bearer KEY``.
"""

import argparse
import os
import sys
import uuid
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from services.common import defaults, intake_queue, runner, shared_flags, shell
from services.common.model_spec import DEFAULT_MODEL_DIR
from services.gateway.auth import ENV_VAR, parse_keys
from services.gateway.connections import raise_fd_limit
from services.gateway.server import Gateway, GatewayConfig

# The deployment's setting for every gateway (perigee up and the benches set it this way).
LATENESS_ENV = "PERIGEE_MAX_LATENESS_MS"
OVERHEAD_ENV = "PERIGEE_MAX_OVERHEAD_MS"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    shared_flags.Bus.add(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--model-dir", default=None, help="tokenizer + config.json (default models/tiny-llama)"
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the model directory's name)",
    )
    ap.add_argument(
        "--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per hashed KV block"
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument(
        "--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted"
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="default: config.json")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=GatewayConfig.max_inflight,
        help="generation requests served at once; the next gets 429 + Retry-After",
    )
    ap.add_argument(
        "--max-lateness-ms",
        type=float,
        default=float(os.environ.get(LATENESS_ENV) or 0),
        help="answer 429 + Retry-After while a request's first token is overdue by more "
        "than this (unplaced: since sent; placed: since the conductor's TTFT estimate), "
        "or while as many requests wait for their first token as first tokens later than "
        f"this let (an AIMD cap); 0: never; default ${LATENESS_ENV} or 0",
    )
    ap.add_argument(
        "--max-overhead-ms",
        type=float,
        default=float(os.environ.get(OVERHEAD_ENV) or GatewayConfig.max_overhead_s * 1e3),
        help="answer 429 + Retry-After while four requests are unplaced for longer than "
        "this while others are placed (a backlog, not one hiccup), "
        "or while as many requests wait for their first token as first tokens whose "
        "control-plane overhead (their wait less the engine's part, which the prefill "
        "worker reports) was over this let (an AIMD cap); 0: never (perigee up sets 0 "
        "beside vLLM on CPU unless this is set); "
        f"default ${OVERHEAD_ENV} or {GatewayConfig.max_overhead_s * 1e3:g}",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds without any event before a request fails with 504",
    )
    shared_flags.DeadAfter.add(ap, "its requests migrate, or fail with 503")
    ap.add_argument(
        "--wedge-floor",
        type=float,
        default=10.0,
        help="seconds a request may go without progress on a live instance beyond "
        "--wedge-factor x its predicted time before that instance counts as wedged "
        "and the request migrates",
    )
    ap.add_argument(
        "--wedge-factor",
        type=float,
        default=10.0,
        help="multiple of a request's predicted TTFT (before its first token) or its "
        "decode instance's step time (after) allowed without progress",
    )
    ap.add_argument(
        "--migration-limit",
        type=int,
        default=GatewayConfig.migration_limit,
        help="times a request whose prefill or decode instance died is moved to "
        "another with the tokens it has (its prompt KV from the stores); "
        "past it, or with 0, the request fails with 503",
    )
    ap.add_argument(
        "--migration-wait",
        type=float,
        default=GatewayConfig.migration_wait_s,
        help="seconds a migrating request waits for a live instance of the role that "
        "died (the restart of the only one) before it fails with 503",
    )
    intake_queue.add_patience_argument(ap)
    ap.add_argument(
        "--durable-intake",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="publish requests on the JetStream INTAKE work queue, stored before "
        "admission sees them (default: core NATS perigee.requests, resent should an "
        "admission or conductor die before placing them)",
    )
    ap.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish on SIGTERM before a 503",
    )
    shared_flags.Slos.add(
        ap,
        "the stack's, reported on GET /v1/perigee/config (admission and the conductor enforce it)",
    )
    ap.add_argument(
        "--max-connections",
        type=int,
        default=GatewayConfig.max_connections,
        help="HTTP connections open at once; the next gets 503 + Retry-After and is "
        "closed (the gateway raises its open-files limit to fit, within the hard limit)",
    )
    ap.add_argument(
        "--header-timeout",
        type=float,
        default=GatewayConfig.header_timeout_s,
        help="seconds a request's headers may take, from the connection's start (or the "
        "request's first byte on a kept-alive connection); then the connection is closed",
    )
    ap.add_argument(
        "--body-timeout",
        type=float,
        default=GatewayConfig.body_timeout_s,
        help="seconds a request's body may take after its headers; then 408. A request "
        "counts against --max-inflight once its body is in",
    )
    ap.add_argument(
        "--keepalive-timeout",
        type=float,
        default=GatewayConfig.keepalive_timeout_s,
        help="seconds an idle kept-alive connection stays open (keep it above a reverse "
        "proxy's own, nginx's 60 s)",
    )
    ap.add_argument(
        "--max-messages",
        type=int,
        default=GatewayConfig.max_messages,
        help="chat messages in one request; more is a 400",
    )
    ap.add_argument(
        "--content-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=GatewayConfig.content_special_tokens,
        help="a special token's string in a chat message (<|im_start|>) becomes that "
        "control token, as in vLLM; by default it is plain text, as in OpenAI's API, and "
        "only the chat template's markup makes special tokens",
    )
    ap.add_argument(
        "--tool-call-parser",
        default=None,
        help="vLLM's tool parser for tool_choice auto (e.g. hermes, llama3_json, mistral); "
        "without it a request must choose none, required or a named tool",
    )
    ap.add_argument("--gateway-id", default="", help="default: random")
    ap.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"accept this Bearer key (repeatable, or a comma list; also ${ENV_VAR}); "
        "default: no authentication",
    )
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        model_dir=args.model_dir,
        served_model_name=args.served_model_name or Path(args.model_dir or DEFAULT_MODEL_DIR).name,
        block_size=args.block_size,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_model_len=args.max_model_len,
        max_body_bytes=args.max_body_bytes,
        max_inflight=args.max_inflight,
        max_lateness_s=args.max_lateness_ms / 1e3,
        max_overhead_s=args.max_overhead_ms / 1e3,
        request_timeout_s=args.request_timeout,
        dead_after_s=args.dead_after,
        wedge_factor=args.wedge_factor,
        wedge_floor_s=args.wedge_floor,
        migration_limit=args.migration_limit,
        migration_wait_s=args.migration_wait,
        gateway_id=args.gateway_id,
        api_keys=parse_keys(args.api_key),
        durable_intake=args.durable_intake,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        intake_patience_s=args.intake_patience,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_messages=args.max_messages,
        content_special_tokens=args.content_special_tokens,
        tool_call_parser=args.tool_call_parser,
    )


async def amain(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # Each connection is a socket; the bus, the model files and logs take a few more.
    raise_fd_limit(cfg.max_connections + 256)
    # Drawn here: the connection's reconnect notices name it (services.gateway.replies).
    args.gateway_id = args.gateway_id or uuid.uuid4().hex[:12]

    def build(nc: NATS) -> Gateway:
        structlog.get_logger().info("gateway_auth", api_keys=len(cfg.api_keys))
        return Gateway(cfg, nc)

    async def close(gw: Gateway) -> None:
        structlog.get_logger().info("gateway_closing", in_flight=gw.router.in_flight)
        await gw.close(args.shutdown_grace)

    return await shell.serve(
        "gateway",
        args,
        build,
        sender=args.gateway_id,
        stop=close,
        # In-flight requests get the grace, then a 503 and a few seconds to say so.
        bound_s=args.shutdown_grace + 3.0,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
