"""Live and simulated agree (issue 5 item 9): a slice of the conversation trace replayed
through the live stack (mock engine) and through the simulator, same cost model, same
speedup, same cluster shape, same block size and store capacity
(``perigee bench agreement``, which also reports how close their median TTFTs are: a
speed, so a benchmark's figure, not a test's assertion).

Both sides serve every request, and both find the same share of prompt tokens in the
cache: placement (which prefix lands where, which instance a request goes to) and the
stores' capacity behave alike.
"""

import json

import pytest

from perigee.bench import agreement
from perigee.bench.stats import unmeasured

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``perigee bench agreement`` at its default slice, read back from its JSON."""
    tmp = tmp_path_factory.mktemp("live-vs-sim")
    path = tmp / "agreement.json"
    assert agreement.main(["--log-dir", str(tmp / "logs"), "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    print(out)
    return out


def test_live_and_simulated_agree_on_hit_rate(results):
    live, sim = results["live"], results["sim"]
    assert live["completed"] == agreement.SLICE, results
    assert sim["completed"] == agreement.SLICE, results
    assert abs(live["hit_rate"] - sim["hit_rate"]) <= 0.05, results


def test_the_bench_reports_finite_figures(results):
    """Both sides' median TTFT and hit rate, and their ratio, are measured (a NaN here
    is the bench's measurement broken, not a disagreement)."""
    bad = unmeasured(results, "live.*", "sim.*", "ttft_p50_live_over_sim")
    assert not bad, f"not measured: {bad}"
