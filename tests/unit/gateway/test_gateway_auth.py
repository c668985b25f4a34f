"""Optional API keys at the gateway: Bearer auth, OpenAI's 401 body, /health open."""

import aiohttp
import nats
import pytest

from services.common.clock import ManualClock
from services.gateway.__main__ import config_from_args, parse_args
from services.gateway.auth import MISSING, WRONG, check, parse_keys
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_http import TOK, FakeBackend, serve_ok


def test_parse_keys_repeated_comma_and_env():
    assert parse_keys(["a", "b,c", " c "], env={}) == ("a", "b", "c")
    assert parse_keys([], env={"PERIGEE_API_KEY": "k1, k2"}) == ("k1", "k2")
    assert parse_keys(["a"], env={"PERIGEE_API_KEY": "a,z"}) == ("a", "z")
    assert parse_keys(None, env={}) == ()


def test_check_header():
    keys = ("sk-1", "sk-2")
    assert check("Bearer sk-2", keys) is None
    assert check("bearer  sk-1 ", keys) is None
    assert check(None, keys) == MISSING
    assert check("Basic sk-1", keys) == MISSING
    assert check("Bearer ", keys) == MISSING
    assert check("Bearer sk-3", keys) == WRONG


def test_cli_flag_and_env(monkeypatch):
    monkeypatch.setenv("PERIGEE_API_KEY", "from-env")
    cfg = config_from_args(parse_args(["--api-key", "a,b", "--api-key", "c"]))
    assert cfg.api_keys == ("a", "b", "c", "from-env")
    monkeypatch.delenv("PERIGEE_API_KEY")
    assert config_from_args(parse_args([])).api_keys == ()


@pytest.fixture
async def keyed(nats_url):
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the fake admission is on core NATS
        max_model_len=128,
        max_tokens_limit=100,
        sweep_interval_s=0,
        api_keys=("sk-good", "sk-other"),
    )
    nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=ManualClock()).start()
    backend = await FakeBackend(nc_be, serve_ok).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        yield gw, backend, http, f"http://127.0.0.1:{gw.port}"
    await gw.close()
    await nc_gw.close()
    await nc_be.close()


async def test_401_without_or_with_a_wrong_key(keyed):
    gw, backend, http, base = keyed
    body = {"prompt": "hi", "max_tokens": 2}
    for headers, message in (
        (None, MISSING),
        ({"Authorization": "Bearer sk-bad"}, WRONG),
        ({"Authorization": "sk-good"}, MISSING),
    ):
        async with http.post(base + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert await r.json() == {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
    async with http.get(base + "/v1/models") as r:
        assert r.status == 401
    assert backend.requests.empty()  # nothing reached the bus


async def test_right_key_passes_and_health_metrics_stay_open(keyed):
    gw, backend, http, base = keyed
    for key in ("sk-good", "sk-other"):
        async with http.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            assert r.status == 200
            assert (await r.json())["object"] == "chat.completion"
    async with http.get(base + "/health") as r:
        assert r.status == 200
    async with http.get(base + "/metrics") as r:
        assert r.status == 200
        assert "perigee:request_errors_total" in await r.text()
