"""The capacity bench's lean HTTP client against real servers on loopback."""

import asyncio

import pytest
from aiohttp import web

from perigee.bench.lean_http import HttpError, LeanClient, Reply
from perigee.natsd import free_port


async def aiohttp_server(handler) -> tuple[web.AppRunner, str]:
    """An aiohttp app serving ``handler`` at /v1/completions, and its address."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _post_all(handler, *bodies: bytes) -> list[Reply]:
    """Each of ``bodies`` posted in turn by one client to ``handler``'s server."""
    runner, url = await aiohttp_server(handler)
    try:
        async with LeanClient(url) as client:
            return [await client.post("/v1/completions", b) for b in bodies]
    finally:
        await runner.cleanup()


async def _raw_server(reply: bytes) -> tuple[asyncio.Server, str]:
    """Answers every request with ``reply``, then closes the connection."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (await r.readline()) not in (b"\r\n", b""):
            pass
        w.write(reply)
        await w.drain()
        w.close()

    port = free_port()
    return await asyncio.start_server(serve, "127.0.0.1", port), f"http://127.0.0.1:{port}"


async def test_a_stream_is_read_to_its_end_and_its_connection_reused():
    peers = []
    bodies = []

    async def completions(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        bodies.append(await request.json())
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b'data: {"choices": [{"role": "assistant"}]}\n\n')  # no text yet
        await r.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await r.write(b"data: [DONE]\n\n")
        return r

    replies = await _post_all(completions, b'{"prompt": "x"}', b'{"prompt": "y"}')
    for r in replies:
        assert r.status == 200 and r.done and r.first_s > 0
    assert bodies == [{"prompt": "x"}, {"prompt": "y"}]
    assert peers[0] == peers[1]  # the same kept-alive connection


async def test_a_stream_without_text_has_no_first_token():
    async def completions(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b"data: [DONE]\n\n")
        return r

    (r,) = await _post_all(completions, b"{}")
    assert r.status == 200 and r.done and r.first_s != r.first_s


async def test_a_refusal_is_read_by_its_length():
    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "1"})

    r, again = await _post_all(completions, b"{}", b"{}")
    assert (r.status, r.body, r.done) == (429, b'{"error": "busy"}', False)
    assert again.status == 429


async def test_a_connection_the_server_closes_is_not_reused():
    reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    server, url = await _raw_server(reply)
    try:
        async with LeanClient(url) as client:
            first = await client.post("/v1/completions", b"{}")
            second = await client.post("/v1/completions", b"{}")  # a new connection
    finally:
        server.close()
    assert (first.status, first.body) == (second.status, second.body) == (200, b"ok")
    assert not client._idle


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n20\r\ndata: {", EOFError),
        (b"SPDY/9 what\r\n\r\n", HttpError),
    ],
    ids=["cut short", "garbled"],
)
async def test_a_reply_cut_short_or_garbled_raises_and_its_connection_goes(reply, error):
    server, url = await _raw_server(reply)
    client = LeanClient(url)
    try:
        with pytest.raises(error):
            await client.post("/v1/completions", b"{}")
    finally:
        server.close()
    assert not client._open and not client._idle


def test_only_http_addresses():
    with pytest.raises(ValueError):
        LeanClient("https://127.0.0.1:1")


class _Wire:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


async def test_a_reply_is_parsed_however_its_bytes_are_split():
    from perigee.bench.lean_http import _Connection

    events = [b'data: {"choices": [{}]}\n\n', b'data: {"choices": [{"text": 1}]}\n\n']
    events.append(b"data: [DONE]\n\n")  # the first has no text yet
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    reply += b"Transfer-Encoding: chunked\r\n\r\n"
    reply += b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    reply += b"0\r\nTrailer: x\r\n\r\n"
    for step in (1, 2, 7, len(reply)):
        conn = _Connection()
        wire = _Wire()
        conn.connection_made(wire)
        done = conn.send(b"POST / HTTP/1.1\r\n\r\n", 0.0)
        for i in range(0, len(reply), step):
            conn.data_received(reply[i : i + step])
        r, keep = await done
        assert (r.status, r.done, keep) == (200, True, True) and r.first_s > 0
        assert wire.written == b"POST / HTTP/1.1\r\n\r\n" and not wire.closed


async def test_a_body_to_the_connections_end_is_read_and_not_kept():
    from perigee.bench.lean_http import _Connection

    conn = _Connection()
    conn.connection_made(_Wire())
    done = conn.send(b"x", 0.0)
    conn.data_received(b"HTTP/1.0 503 Busy\r\n\r\nno ")
    conn.data_received(b"room")
    conn.connection_lost(None)
    r, keep = await done
    assert (r.status, r.body, keep) == (503, b"no room", False)
