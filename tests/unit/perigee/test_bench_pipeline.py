"""perigee bench pipeline: each request's outcome by kind, a 429 apart from a failure."""

import asyncio

import aiohttp
from aiohttp import web

from perigee.bench.pipeline import drive, one_request
from perigee.bench.stats import outcomes
from perigee.natsd import free_port
from tests.unit.perigee.test_lean_http import aiohttp_server


async def _by_prompt(request: web.Request) -> web.StreamResponse:
    """Request i (from its prompt): served for i % 4 == 0, 429 for 1, 500 for 2, and a
    stream cut before [DONE] for 3."""
    i = int((await request.json())["prompt"].split()[2].rstrip(":"))
    if i % 4 == 1:
        return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "1"})
    if i % 4 == 2:
        return web.json_response({"error": "boom"}, status=500)
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
    if i % 4 == 0:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _each(*ids: int) -> list[tuple[str, float]]:
    runner, url = await aiohttp_server(_by_prompt)
    try:
        async with aiohttp.ClientSession() as http:
            return [await one_request(http, url, i) for i in ids]
    finally:
        await runner.cleanup()


def test_each_request_ends_served_turned_away_failed_or_cut():
    got = asyncio.run(_each(0, 1, 2, 3))
    assert [kind for kind, _ in got] == ["ok", "429", "500", "cut"]
    assert got[0][1] > 0
    assert all(t != t for _, t in got[1:])  # NaN: no first token counted


def test_a_refused_connection_is_a_failure_of_its_kind_not_a_crash():
    async def refused() -> tuple[str, float]:
        async with aiohttp.ClientSession() as http:
            return await one_request(http, f"http://127.0.0.1:{free_port()}", 0)

    kind, t = asyncio.run(refused())
    assert kind == "ClientConnectorError" and t != t


def test_429s_are_counted_apart_from_the_failures():
    ttfts, rejected, errors = outcomes(
        [("ok", 0.01), ("429", float("nan")), ("500", float("nan")), ("ok", 0.02), ("cut", 0.0)]
    )
    assert ttfts == [0.01, 0.02]
    assert rejected == 1
    assert errors == {"500": 1, "cut": 1}


def test_an_open_loop_run_reports_every_outcome():
    async def run() -> tuple[list[float], int, dict[str, int]]:
        runner, url = await aiohttp_server(_by_prompt)
        try:
            return await drive(url, 8, 400.0, 0)
        finally:
            await runner.cleanup()

    ttfts, rejected, errors = asyncio.run(run())
    assert (len(ttfts), rejected, errors) == (2, 2, {"500": 2, "cut": 2})
