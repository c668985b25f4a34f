"""Optional API keys: ``Authorization: Bearer KEY``, as OpenAI and vLLM take them.

With no key configured everything is open. With keys, every route but ``/health``, ``/ready`` and
``/metrics`` needs one of them, else 401 with OpenAI's error body
(``{"error": {"message", "type": "invalid_request_error", "param": null,
"code": "invalid_api_key"}}``) and ``WWW-Authenticate: Bearer``.
"""

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from services.common.placeholders import refuse_placeholder
from services.gateway.protocol import ApiError
from services.gateway.responses import error_response

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
ENV_VAR = "PERIGEE_API_KEY"

MISSING = (
    "You didn't provide an API key. You need to provide your API key in an "
    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG = "Incorrect API key provided."


def parse_keys(values: Iterable[str] | None, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """Keys from repeated/comma-separated ``--api-key`` values plus ``PERIGEE_API_KEY``."""
    env = os.environ if env is None else env
    raw = [*(values or ()), env.get(ENV_VAR, "")]
    keys: list[str] = []
    for v in raw:
        for k in v.split(","):
            k = k.strip()
            if k and k not in keys:
                refuse_placeholder("an API key", k, f"--api-key or ${ENV_VAR}")
                keys.append(k)
    return tuple(keys)


def check(header: str | None, keys: tuple[str, ...]) -> str | None:
    """None when ``header`` carries one of ``keys``, else the error message."""
    scheme, _, token = (header or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return MISSING
    ok = False
    for k in keys:  # compare with every key: the time does not say which one is close
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return None if ok else WRONG


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(keys: tuple[str, ...], on_reject: Callable[[int], None] | None = None):
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path not in OPEN_PATHS:
            problem = check(request.headers.get("Authorization"), keys)
            if problem is not None:
                if on_reject is not None:
                    on_reject(401)
                return error_response(
                    ApiError(
                        401,
                        problem,
                        type="invalid_request_error",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                )
        return await handler(request)

    return auth
