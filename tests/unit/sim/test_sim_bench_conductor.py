"""perigee bench conductor on a small index: the shape of its result."""

from perigee.bench import BENCHES
from perigee.bench.conductor import build_index, run


def test_index_holds_every_block_on_one_to_three_nodes():
    import random

    index = build_index(instances=8, blocks=640, chain=32, rng=random.Random(0))
    assert index.num_blocks() == 640
    assert len(index.nodes()) <= 8
    m = index.match(list(range(32)))  # chain 0 is held by exactly one node
    assert len(m) == 1 and list(m.values()) == [32]
    assert len(index.match(list(range(64, 96)))) == 3  # chain 2: three replicas


def test_a_cluster_smaller_than_the_replicas_holds_every_block():
    """One or two prefill nodes: a chain's one to three replicas are at most all of
    them (``--instances 1`` crashed on sampling three of one)."""
    import random

    for instances in (1, 2):
        index = build_index(instances=instances, blocks=320, chain=32, rng=random.Random(0))
        assert index.num_blocks() == 320 and len(index.nodes()) == instances
    s = run(instances=1, decodes=1, blocks=320, chain=32, placements=20, warmup=5)
    assert s["placed"] == 20


def test_run_reports_placement_latency():
    s = run(instances=8, decodes=2, blocks=6400, chain=32, placements=200, warmup=10)
    assert set(s["placement_us"]) >= {"p50", "p99"}
    assert (s["instances"], s["indexed_blocks"], s["placements"]) == (8, 6400, 200)
    assert s["placed"] == 200
    assert BENCHES["conductor"] == "perigee.bench.conductor"


def test_the_cli_reports_finite_figures(tmp_path):
    """``perigee bench conductor`` at a small size: every latency figure measured."""
    import json

    from perigee.bench import main
    from perigee.bench.stats import unmeasured

    path = tmp_path / "conductor.json"
    argv = ["--instances", "4", "--decodes", "1", "--blocks", "320", "--placements", "20"]
    assert main(["conductor", *argv, "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert not unmeasured(s, "placement_us.p50", "placement_us.p99", "placement_us.mean")
    assert (s["indexed_blocks"], s["placements"], s["placed"]) == (320, 20, 20)


def test_idle_run_places_every_request():
    """``--idle``: every instance reports nothing queued or running (all tie)."""
    s = run(instances=8, decodes=4, blocks=640, chain=32, placements=50, warmup=5, idle=True)
    assert s["idle"] and s["placed"] == 50


def test_the_configurations_of_the_search_run_and_agree_with_the_scan():
    """--cpp-group, --overloaded and --fitted: the pruned search and the scan place the
    same number; an overloaded decode pool rejects every request (TBT check on)."""
    kw = dict(instances=8, decodes=4, blocks=3200, chain=32, placements=60, warmup=5)
    for flags in (dict(cpp_group=2, cpp_min_tokens=8192), dict(overloaded=True), dict(fitted=True)):
        a, b = run(**kw, **flags), run(**kw, **flags, scan=True)
        assert a["placed"] == b["placed"]
        assert a["placed"] == (0 if flags.get("overloaded") else 60)
