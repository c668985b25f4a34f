"""A short ``perigee bench chaos``: a small trace slice on the mock engine, replayed on a
supervised stack (--nats-cluster 3, two conductors, 2 prefill + 2 decode) while a
decode worker, a prefill worker, a store, a conductor, admission and a nats-server are
SIGKILLed one after another. No accepted request is lost, and every request that did
not complete got an explicit answer: a 429 or 503 with a message, never a hang or a
cut stream. Real nats-servers, real processes; no timing is asserted."""

import json

import pytest

from perigee.bench import chaos
from perigee.bench.stats import unmeasured

pytestmark = pytest.mark.e2e


def test_a_chaos_run_loses_no_accepted_request(tmp_path):
    path = tmp_path / "chaos.json"
    chaos.main(
        [
            "--requests",
            "60",
            "--trace-speedup",
            "1",
            "--speedup",
            "100",
            "--fault-gap",
            "1",
            "--request-timeout",
            "90",
            "--log-dir",
            str(tmp_path / "logs"),
            "--json",
            str(path),
        ]
    )
    out = json.loads(path.read_text())
    assert out["faults"] == list(chaos.FAULTS)  # every fault was injected
    # The supervisor brought each killed service back.
    assert all(out["restarts"].get(name, 0) >= 1 for name in chaos.FAULTS), out["restarts"]
    assert out["accepted_lost"] == 0, out["lost"]
    c = out["chaos"]
    assert c["requests"] == 60
    for key, n in out["errors"].items():
        status, _, message = key.partition(" ")
        assert status in ("429", "503") and message.strip(), (key, n)
    assert c["completed"] + sum(out["errors"].values()) == c["requests"], out
    assert c["completed"] > 0
    # The bench's own figures are measured: each fault's restart and return, and the
    # p99 TTFT of both runs and its cost (NaN or None: the bench stopped seeing them).
    assert out["quiet"]["completed"] > 0
    bad = unmeasured(out, "recovery.*.restart_ms", "recovery.*.back_ms", "ttft_p99_ms.*")
    assert not bad, f"not measured: {bad}"
