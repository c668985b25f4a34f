"""GET /v1/perigee/config tells a client the stack's SLOs (perigee replay grades with
them), and a request for a model the gateway does not serve gets a 404 naming the one
it does. The gateway in-process on a real port, on a real nats-server."""

import aiohttp
import nats
import pytest

from services.common.tokenizer import Tokenizer
from services.gateway.__main__ import config_from_args, parse_args
from services.gateway.server import Gateway, GatewayConfig

TOK = Tokenizer.from_dir()


@pytest.fixture
async def base(nats_url):
    args = parse_args(
        ["--port", "0", "--ttft-slo", "15", "--tbt-slo", "1.0", "--no-durable-intake"]
    )
    cfg = config_from_args(args)
    assert (cfg.ttft_slo_s, cfg.tbt_slo_s) == (15.0, 1.0)
    nc = await nats.connect(nats_url)
    gw = await Gateway(cfg, nc, tokenizer=TOK).start()
    yield f"http://127.0.0.1:{gw.port}"
    await gw.close()
    await nc.close()


async def test_config_reports_the_slos(base):
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/perigee/config") as r:
        assert r.status == 200
        cfg = await r.json()
    assert cfg["ttft_slo_s"] == 15.0 and cfg["tbt_slo_s"] == 1.0
    assert cfg["model"] == "tiny-llama" and cfg["max_model_len"] > 0


async def test_a_wrong_model_is_a_404_naming_the_served_one(base):
    body = {"model": "gpt-4", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as http, http.post(base + "/v1/completions", json=body) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`gpt-4`" in err["message"] and "`tiny-llama`" in err["message"]


def test_defaults_are_the_gpu_slos():
    cfg = config_from_args(parse_args([]))
    assert (cfg.ttft_slo_s, cfg.tbt_slo_s) == (GatewayConfig.ttft_slo_s, GatewayConfig.tbt_slo_s)


async def test_replay_reads_the_slos_from_the_gateway(base):
    from perigee.replay import stack_slos

    assert await stack_slos(base, None) == (15.0, 1.0)
    # An endpoint without it (here: a path that answers 404) leaves the choice to replay.
    assert await stack_slos(base + "/nothing", None) is None


def test_the_overhead_gate_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("PERIGEE_MAX_OVERHEAD_MS", raising=False)
    assert config_from_args(parse_args([])).max_overhead_s == 0.02
    monkeypatch.setenv("PERIGEE_MAX_OVERHEAD_MS", "")  # set but empty: the default
    assert config_from_args(parse_args([])).max_overhead_s == 0.02
    monkeypatch.setenv("PERIGEE_MAX_OVERHEAD_MS", "0")
    assert config_from_args(parse_args([])).max_overhead_s == 0.0
    assert config_from_args(parse_args(["--max-overhead-ms", "35"])).max_overhead_s == 0.035
