"""A service given a template's placeholder secret (``REPLACE-ME-...``, as in
deploy/k8s/base/credentials.env) refuses to start with a message naming it, before it
connects or serves: real service processes, exit status 1, no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.placeholders import PlaceholderSecret, refuse_placeholder
from services.gateway.auth import parse_keys

ROOT = Path(__file__).resolve().parents[3]
CREDENTIALS = ROOT / "deploy" / "k8s" / "base" / "credentials.env"


def test_the_template_values_are_refused():
    values = [
        line.split("=", 1)[1]
        for line in CREDENTIALS.read_text().splitlines()
        if "-password=" in line or line.startswith("api-key=")
    ]
    assert values
    for v in values:
        with pytest.raises(PlaceholderSecret, match="REPLACE-ME"):
            refuse_placeholder("x", v)
    refuse_placeholder("x", "a-real-secret")
    refuse_placeholder("x", None)


def test_a_placeholder_api_key_is_refused():
    with pytest.raises(PlaceholderSecret, match="API key"):
        parse_keys([], {"PERIGEE_API_KEY": "k1,REPLACE-ME-gateway-api-key"})
    assert parse_keys(["k1"], {}) == ("k1",)


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("service", ["admission", "conductor", "store"])
def test_a_service_with_a_placeholder_nats_password_refuses(service):
    argv = [f"services.{service}", "--nats", "nats://127.0.0.1:9"]  # nothing listens there
    if service == "store":
        argv += ["--node", "n0"]
    r = _run(argv, NATS_USER=service, NATS_PASSWORD=f"REPLACE-ME-{service}-nats-password")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refusing to start" in r.stderr and "REPLACE-ME" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_the_gateway_with_a_placeholder_api_key_refuses():
    r = _run(
        ["services.gateway", "--nats", "nats://127.0.0.1:9"],
        PERIGEE_API_KEY="REPLACE-ME-gateway-api-key",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refusing to start: an API key" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
