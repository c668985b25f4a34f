"""perigee.stack wiring for observability (no processes): a /metrics port per service,
Prometheus file_sd targets, the spans file, the gateway's API key."""

import json

from perigee.stack import Stack, StackConfig
from services.common import admission_mode


def test_metrics_ports_targets_and_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("PERIGEE_SPANS_FILE", raising=False)
    s = Stack(StackConfig(port=18000, log_dir=str(tmp_path / "logs"), api_key="k1,k2"))
    children = s.observability(s.plan())
    by_name = {c.name: c for c in children}
    assert by_name["gateway"].env == {"PERIGEE_API_KEY": "k1,k2"}
    assert "--api-key" not in by_name["gateway"].argv  # not visible in ps
    ports = {}
    for c in children:
        if c.name == "gateway":
            assert "--metrics-port" not in c.argv
            continue
        i = c.argv.index("--metrics-port")
        ports[c.name] = int(c.argv[i + 1])
        assert c.argv[c.argv.index("--metrics-host") + 1] == "127.0.0.1"
        # No API key (nor anything but the admission mode) reaches the other services.
        assert set(c.env) <= {admission_mode.ENV}
    assert len(set(ports.values())) == len(ports) == len(children) - 1
    targets = json.loads((tmp_path / "logs" / "metrics-targets.json").read_text())
    assert {t["labels"]["service"]: t["targets"] for t in targets} == {
        **{n: [f"127.0.0.1:{p}"] for n, p in ports.items()},
        "gateway": ["127.0.0.1:18000"],
    }
    assert {t["labels"]["role"] for t in targets} == {
        "store",
        "prefill",
        "decode",
        "admission",
        "conductor",
        "gateway",
    }
    assert s.metrics_urls["gateway"] == "http://127.0.0.1:18000/metrics"
    assert s.spans_file == str(tmp_path / "logs" / "spans.jsonl")


def test_metrics_off_and_spans_file_from_extra_env(tmp_path):
    cfg = StackConfig(
        log_dir=str(tmp_path),
        metrics=False,
        extra_env={"PERIGEE_SPANS_FILE": str(tmp_path / "x.jsonl")},
    )
    s = Stack(cfg)
    children = s.observability(s.plan())
    assert all("--metrics-port" not in c.argv for c in children)
    assert all(set(c.env) <= {admission_mode.ENV} for c in children)
    assert not (tmp_path / "metrics-targets.json").exists()
    assert s.spans_file == str(tmp_path / "x.jsonl")


def test_the_durable_intake_is_set_on_the_gateway_admission_and_conductors(tmp_path):
    def flagged(**kw) -> set[str]:
        s = Stack(StackConfig(port=18000, log_dir=str(tmp_path / "logs"), conductors=2, **kw))
        return {c.name for c in s.observability(s.plan()) if "--durable-intake" in c.argv}

    assert flagged() == set()  # the core path, the services' default
    assert flagged(durable_intake=True) == {"gateway", "admission", "conductor-0", "conductor-1"}
