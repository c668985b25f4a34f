"""The data key (``PERIGEE_DATA_KEY``) a deployment hands every store and worker: a
template's placeholder (``REPLACE-ME-...``, deploy/k8s/base/credentials.env) stops a
store or a worker at start, before it connects, with a message naming it (exit 1, no
traceback); a real key is taken as it is."""

from pathlib import Path

import pytest

from services.common.placeholders import PlaceholderSecret
from services.transfer import data_auth
from tests.unit.common.test_placeholder_secrets import _run

ROOT = Path(__file__).resolve().parents[3]
CREDENTIALS = ROOT / "deploy" / "k8s" / "base" / "credentials.env"


@pytest.fixture
def fresh_key(monkeypatch):
    monkeypatch.setattr(data_auth, "_key", None)  # read the environment again
    yield monkeypatch
    data_auth._key = None


def template_key() -> str:
    lines = CREDENTIALS.read_text().splitlines()
    return next(v for k, _, v in (line.partition("=") for line in lines) if k == "data-key")


def test_a_placeholder_key_is_refused(fresh_key):
    placeholder = template_key()
    assert "REPLACE-ME" in placeholder
    for value in (placeholder, "replace-me-but-in-lower-case"):
        fresh_key.setenv(data_auth.ENV, value)
        data_auth._key = None
        with pytest.raises(PlaceholderSecret, match=f"data key {data_auth.ENV}"):
            data_auth.data_key()


def test_a_real_key_is_taken(fresh_key):
    real = data_auth.new_key()
    fresh_key.setenv(data_auth.ENV, real)
    assert data_auth.data_key() == real.encode()


@pytest.mark.parametrize("service", ["store", "prefill", "decode"])
def test_a_store_or_worker_with_a_placeholder_key_refuses_before_it_connects(service):
    argv = [f"services.{service}", "--nats", "nats://127.0.0.1:9", "--node", "n0"]
    r = _run(argv, **{data_auth.ENV: template_key()})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refusing to start: the data key PERIGEE_DATA_KEY" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
