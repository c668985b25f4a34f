"""``perigee up --nats-cluster 3``: three clustered nats-servers, JetStream with three
replicas, every service connected with the whole server list. One server SIGKILLed
while requests stream: every request completes with all its tokens (those in flight
through the dead server are lost, core NATS being at most once: the clients of that
server announce their reconnection and the gateway resumes its requests from the
tokens each client has), every service is back on the bus, and a replicated stream
keeps every message."""

import asyncio
import json
import signal
import urllib.request

import aiohttp
import pytest
from nats.js.api import StreamConfig

from services.common import bus
from tests.e2e.conftest import make_stack
from tests.e2e.sse import StreamResult, stream

pytestmark = pytest.mark.e2e

SERVICES = {
    "gateway",
    "admission",
    "conductor-0",
    "prefill-prefill-0",
    "decode-decode-0",
    "store-p0",
    "store-d0",
}
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def clustered(tmp_path_factory):
    s = make_stack(
        tmp_path_factory, "cluster", engine="mock", prefill=1, decode=1, speedup="1", nats_cluster=3
    )
    s.start()
    yield s
    s.stop()


def _connz(srv) -> list[dict]:
    url = f"http://127.0.0.1:{srv.monitor_port}/connz?auth=true&limit=1000"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["connections"] or []


def _names(servers) -> dict[str, str]:
    """Connection name -> the server it is on."""
    return {c.get("name"): srv.name for srv in servers for c in _connz(srv)}


async def _stream(http, url: str, body: dict, started: asyncio.Event) -> StreamResult:
    """tests.e2e.sse.stream, setting ``started`` at the first token."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body) as r:
        res = StreamResult(status=r.status)
        if r.status != 200:
            res.error = await r.json()
            started.set()
            return res
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj
                break
            res.chunks.append(obj)
            started.set()
        return res


async def _until(cond, what: str) -> None:
    async def loop():
        while not cond():
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(loop(), DEADLINE_S)
    except TimeoutError:
        pytest.fail(f"not within {DEADLINE_S:g} s: {what}")


async def test_three_servers_and_services_with_the_whole_list(clustered):
    s = clustered
    servers = s.nats.servers
    assert len(servers) == 3 and all(srv.proc.poll() is None for srv in servers)
    assert s.nats.url.count(",") == 2
    for child in s.children.values():
        assert child.argv[child.argv.index("--nats") + 1] == s.nats.url
        assert child.env["PERIGEE_JS_REPLICAS"] == "3"
    await _until(lambda: SERVICES <= set(_names(servers)), "every service on the bus")
    url = f"http://127.0.0.1:{servers[0].monitor_port}/routez"
    with urllib.request.urlopen(url, timeout=5) as r:
        routes = json.loads(r.read())["routes"]
    assert {r.get("remote_name") for r in routes} >= {"n1", "n2"}


async def test_killing_one_server_mid_load_loses_nothing(clustered):
    s = clustered
    servers = s.nats.servers
    await _until(lambda: SERVICES <= set(_names(servers)), "every service on the bus")
    # Kill the server the gateway is on: its clients' streams must move to the others.
    victim = next(srv for srv in servers if srv.name == _names(servers)["gateway"])
    survivors = [srv for srv in servers if srv is not victim]

    nc = await bus.connect(",".join(u for u in s.nats_urls.split(",")), name="test-js")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="CHAOS", subjects=["chaos.>"], num_replicas=3))
    info = await js.stream_info("CHAOS")
    assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2

    n, max_tokens = 8, 60
    body = {"prompt": "tell me a long story", "max_tokens": max_tokens, "ignore_eos": True}
    first_chunks = [asyncio.Event() for _ in range(n)]
    acked = 0

    async def one(i: int, http):
        return await _stream(http, s.url, body, first_chunks[i])

    async with aiohttp.ClientSession() as http:
        # The mock's tokens follow the context: a lost, repeated or shifted token
        # changes the text.
        ref = await stream(http, s.url, body)
        assert ref.status == 200 and ref.done, ref.error
        tasks = [asyncio.create_task(one(i, http)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunks)), DEADLINE_S)
        for k in range(20):
            await bus.js_publish(js, f"chaos.{k}", b"before", msg_id=f"m{k}")
            acked += 1
        assert not any(t.done() for t in tasks), "requests finished before the kill"
        victim.kill()
        for k in range(20, 40):  # acked by the surviving majority, after an election
            await bus.js_publish(js, f"chaos.{k}", b"after", msg_id=f"m{k}", timeout=30)
            acked += 1
        results = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S * 2)
        for r in results:
            assert r.status == 200 and r.done and r.error is None, (r.status, r.error)
            assert r.usage["completion_tokens"] == max_tokens
            assert r.text == ref.text
        await _until(
            lambda: SERVICES <= set(_names(survivors)),
            "every service reconnected to a surviving server",
        )
        after = await stream(
            http, s.url, {"prompt": "and another", "max_tokens": 5, "ignore_eos": True}
        )
    assert after.status == 200 and after.done and after.error is None, after.error
    info = await js.stream_info("CHAOS")
    assert info.state.messages == acked == 40
    await nc.close()
    assert not s.exited()
    assert victim.proc.returncode == -signal.SIGKILL
