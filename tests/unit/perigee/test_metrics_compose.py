"""compose.yaml: every perigee service serves /metrics and Prometheus scrapes them all."""

import re
from pathlib import Path

from tests.unit.perigee.test_compose import config  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[3]


def test_every_service_has_a_metrics_port_that_prometheus_scrapes(config):  # noqa: F811
    services = config["services"]
    scrape = (ROOT / "deploy" / "prometheus.yml").read_text()
    targets = set(re.findall(r'"([a-z0-9-]+:\d+)"', scrape))
    perigee = {n: s for n, s in services.items() if s.get("image") == "perigee:latest"}
    assert len(perigee) == 7
    for name, s in perigee.items():
        if name == "gateway":
            assert "gateway:8000" in targets  # /metrics on its own HTTP port
            continue
        assert "--metrics-port=9400" in s["command"], name
        assert "--metrics-host=0.0.0.0" in s["command"], name
        assert f"{name}:9400" in targets, name
    prom = services["prometheus"]
    assert any("prometheus.yml" in str(v) for v in prom["volumes"])
