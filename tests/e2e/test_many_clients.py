"""Many clients against one gateway (mock engine, real processes, real sockets).

- 1,000 concurrent streaming clients against a gateway capped at CAP in flight: each
  ends either complete with all its tokens or refused (429 + Retry-After, or 503)
  before any token; the cap refused some; the gateway's memory stays bounded and it
  serves afterwards.
- A client that hangs up cancels its request and frees its KV transactions. The
  transaction lease is an hour, so a lease running out cannot be what closes them, and
  the stores count aborted apart from committed transactions, so the request finishing
  cannot either: the stores' own open-transaction count is the observable.
"""

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e

N_CLIENTS = 1000
CAP = 400
MAX_TOKENS = 16
LEASE_S = 3600.0
STORES = ("p0", "d0")
CAP_MESSAGE = "serving its limit"


class _Stack(Stack):
    """A stack whose gateway and prefill workers get extra flags (``perigee up`` has no
    knob for them)."""

    def __init__(self, cfg: StackConfig, gateway_args=(), prefill_args=()) -> None:
        super().__init__(cfg)
        self.gateway_args, self.prefill_args = list(gateway_args), list(prefill_args)

    def plan(self):
        children = super().plan()
        for c in children:
            if c.name == "gateway":
                c.argv += self.gateway_args
            elif c.name.startswith("prefill-"):
                c.argv += self.prefill_args
        return children


def _start(tmp_path_factory, name: str, gateway_args=(), prefill_args=(), **kw) -> _Stack:
    cfg = StackConfig(
        port=free_port(),
        log_dir=str(tmp_path_factory.mktemp(f"logs-{name}")),
        engine="mock",
        prefill=1,
        decode=1,
        **kw,
    )
    s = _Stack(cfg, gateway_args, prefill_args)
    s.start(timeout=240)  # a slowed engine calibrates slowly before it reports ready
    return s


def _rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(cond, what: str, timeout: float = 60.0, every: float = 0.1):
    """Poll an observable condition (``cond`` is async) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        v = await cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:g} s: {what}")
        await asyncio.sleep(every)


# ------------------------------------------------------------------ 1,000 clients


@pytest.fixture(scope="module")
def crowd(tmp_path_factory):
    # speedup 0.1: a request streams for ~1.4 s of decode after a 7.6 ms prefill, and
    # prefills run one at a time, so the crowd is in flight together and meets the cap.
    # The overhead gate (on by default) would turn the crowd away before it does: this
    # is the in-flight cap's test, and the gate has its own (tests/unit/gateway).
    s = _start(
        tmp_path_factory,
        "crowd",
        gateway_args=["--max-inflight", str(CAP), "--max-overhead-ms", "0"],
        speedup="0.1",
        max_batch=1024,
        tbt_slo=5.0,
        ttft_slo=120.0,
        store_capacity_blocks=8192,
    )
    yield s
    s.stop()


async def test_a_thousand_streaming_clients(crowd):
    url, pid = crowd.url, crowd.children["gateway"].proc.pid
    body = {"prompt": "many clients at once", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        warm = await stream(s, url, body)  # the gateway's steady state before the crowd
        assert warm.status == 200 and warm.done, warm.error
        before = _rss_kib(pid)
        refused_before = await _metric(s, url, "perigee:gateway_requests_over_inflight_cap_total")
        results = await asyncio.gather(
            *(stream(s, url, body) for _ in range(N_CLIENTS)), return_exceptions=True
        )
        after = _rss_kib(pid)
        refused_metric = await _metric(s, url, "perigee:gateway_requests_over_inflight_cap_total")
        cap_metric = await _metric(s, url, "perigee:gateway_max_requests_in_flight")
        # alive and serving afterwards
        again = await stream(s, url, body)
        async with s.get(url + "/health") as r:
            health = r.status

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    for r in served:  # complete, with every token
        assert r.done and r.error is None, r.error
        assert r.usage["completion_tokens"] == MAX_TOKENS
        assert r.chunks[-2]["choices"][0]["finish_reason"] == "length"
    for r in refused:  # refused before any token
        assert r.status in (429, 503), (r.status, r.error)
        assert not r.chunks and r.error["error"]["message"]
        if r.status == 429:
            assert int(r.headers["Retry-After"]) >= 1
    by_cap = [r for r in refused if CAP_MESSAGE in r.error["error"]["message"]]
    print(
        f"\n{N_CLIENTS} clients, cap {CAP}: {len(served)} served, {len(by_cap)} refused "
        f"by the cap, {len(refused) - len(by_cap)} refused by the backend; gateway VmRSS "
        f"{before['VmRSS'] / 1024:.1f} -> {after['VmRSS'] / 1024:.1f} MiB, "
        f"peak {after['VmHWM'] / 1024:.1f} MiB"
    )
    assert len(served) + len(refused) == N_CLIENTS
    assert served, "nothing was served"
    assert by_cap, "the in-flight cap refused nobody"
    assert all(r.status == 429 for r in by_cap)
    assert refused_metric - refused_before == len(by_cap)
    assert cap_metric == CAP
    # Bounded: a generous ceiling, far above what 400 in-flight streams need.
    assert after["VmRSS"] - before["VmRSS"] < 256 * 1024
    assert after["VmHWM"] < 1024 * 1024
    assert again.status == 200 and again.done and health == 200
    assert not crowd.exited()


# ------------------------------------------------------------------ hanging up


@pytest.fixture(scope="module")
def slow_prefill(tmp_path_factory):
    # The prefill engine runs 100x slower than the A800 the cost model describes: a
    # short prompt takes ~0.1 s, an 8000-token one ~45 s.
    s = _start(
        tmp_path_factory,
        "hangup",
        prefill_args=["--engine-speedup", "0.01"],
        speedup="1",
        lease_s=LEASE_S,
        ttft_slo=100000.0,
        tbt_slo=10.0,
    )
    yield s
    s.stop()


async def _stores(nats_url: str) -> dict[str, dict[str, int]]:
    return {n: await worker_stats(nats_url, "store", n) for n in STORES}


async def _open_txs(nats_url: str) -> int:
    return sum(c["open_txs"] for c in (await _stores(nats_url)).values())


async def _hang_up_after(session, url: str, body: dict, chunks: int) -> asyncio.Future | None:
    """Stream ``body``, read ``chunks`` SSE events, then drop the connection; with 0, the
    request is left waiting for its headers and returned: cancelling it hangs up."""
    body = {**body, "stream": True}
    if chunks == 0:
        task = asyncio.ensure_future(session.post(url + "/v1/completions", json=body))
        return task
    r = await session.post(url + "/v1/completions", json=body)
    assert r.status == 200
    for _ in range(chunks):
        await r.content.readuntil(b"\n\n")
    r.close()
    return None


async def test_hang_up_mid_stream_aborts_the_decode(slow_prefill):
    url, nats_url = slow_prefill.url, slow_prefill.nats_url
    async with aiohttp.ClientSession() as s:
        dec0 = await worker_stats(nats_url, "decode", "decode-0")
        tx0 = await _stores(nats_url)
        # ~35 s of decode at 8.6 ms a token: hung up after 3 chunks, long before its end
        await _hang_up_after(
            s, url, {"prompt": "hang up", "max_tokens": 4000, "ignore_eos": True}, chunks=3
        )

        async def aborted():
            d = await worker_stats(nats_url, "decode", "decode-0")
            return d if d["tasks_aborted"] > dec0["tasks_aborted"] else None

        dec = await _until(aborted, "the decode instance aborts the request", timeout=30)
        assert dec["tasks_done"] == dec0["tasks_done"]  # aborted, not finished
        await _until(lambda: _zero(nats_url), "no transaction left open")
        tx = await _stores(nats_url)
        assert all(tx[n]["tx_expired"] == tx0[n]["tx_expired"] for n in STORES)


async def _zero(nats_url: str) -> bool:
    return await _open_txs(nats_url) == 0


async def test_hang_up_during_prefill_frees_its_transactions(slow_prefill):
    """The prefill of 8000 tokens takes ~45 s: its transactions are open when the
    client goes, and only the cancel can close them (lease: an hour; the stores count
    them aborted, not committed)."""
    url, nats_url = slow_prefill.url, slow_prefill.nats_url
    prompt = [1] + [3 + (i * 7) % 1000 for i in range(7999)]
    async with aiohttp.ClientSession() as s:
        await _until(lambda: _zero(nats_url), "a quiet stack first")
        tx0 = await _stores(nats_url)
        task = await _hang_up_after(s, url, {"prompt": prompt, "max_tokens": 4}, chunks=0)

        async def opened():
            return await _open_txs(nats_url)

        assert await _until(opened, "the request holds a transaction", timeout=30) > 0
        assert not task.done()  # no response yet: the prefill is computing
        task.cancel()  # the client hangs up
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: _zero(nats_url), "the cancel closes its transactions", timeout=30)
        tx = await _stores(nats_url)
    assert sum(tx[n]["tx_aborted"] - tx0[n]["tx_aborted"] for n in STORES) >= 1
    assert all(tx[n]["tx_expired"] == tx0[n]["tx_expired"] for n in STORES)
    assert all(tx[n]["tx_committed"] == tx0[n]["tx_committed"] for n in STORES)
    async with aiohttp.ClientSession() as s:  # the stack still serves
        r = await stream(s, url, {"prompt": "still here", "max_tokens": 3, "ignore_eos": True})
    assert r.status == 200 and r.done
    assert not slow_prefill.exited()
