"""``perigee bench multiturn``'s client tries a 429 again after its Retry-After, as the
``openai`` client does, and counts the rejections; without retries it gives up."""

import json

import pytest
from aiohttp import ClientSession, web

from perigee.bench.multiturn import _retry_after, chat_turn

SEEN = web.AppKey("seen", dict)


def _server(rejections: int) -> web.Application:
    seen = {"n": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        seen["n"] += 1
        if seen["n"] <= rejections:
            return web.json_response(
                {"error": {"message": "overloaded"}}, status=429, headers={"Retry-After": "0"}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b"):
            ev = {"choices": [{"delta": {"content": piece}}]}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app[SEEN] = seen
    return app


@pytest.mark.parametrize(
    ("rejections", "retries", "ok", "counted", "calls"),
    [(0, 2, True, 0, 1), (2, 2, True, 2, 3), (3, 2, False, 3, 3), (1, 0, False, 1, 1)],
)
async def test_retries_after_429(rejections, retries, ok, counted, calls):
    app = _server(rejections)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with ClientSession() as http:
            out = await chat_turn(http, f"http://127.0.0.1:{port}", "m", [], 4, retries)
    finally:
        await runner.cleanup()
    assert out["ok"] is ok
    assert out["rejections"] == counted
    assert app[SEEN]["n"] == calls
    if ok:
        assert out["text"] == "ab" and out["prompt_tokens"] == 5
    else:
        assert out["error"].startswith("HTTP 429")


def test_retry_after_header():
    assert _retry_after("3") == 3.0
    assert _retry_after(None) == 1.0
    assert _retry_after("soon") == 1.0
    assert _retry_after("600") == 60.0
