from bus_schemas.requests import ErrorCode
from services.common.clock import ManualClock
from services.gateway.watchdog import Watchdog


def make(dead_after=2.0, timeout=10.0) -> tuple[Watchdog, ManualClock]:
    clock = ManualClock()
    return Watchdog(clock, dead_after, timeout), clock


def test_decode_death_after_first_token():
    wd, clock = make()
    wd.seen("p0")
    wd.seen("d0")
    wd.track("r1")
    wd.accepted("r1", "p0", "d0")
    wd.tokens("r1")
    assert wd.stage("r1") == "decode"
    clock.advance(1.5)
    wd.seen("d0")
    clock.advance(1.5)  # p0 silent 3 s: irrelevant once decoding; d0 silent 1.5 s
    assert wd.sweep() == []
    clock.advance(1.0)  # d0 silent 2.5 s
    [v] = wd.sweep()
    assert (v.request_id, v.code) == ("r1", ErrorCode.UNAVAILABLE)
    assert "decode instance d0" in v.message
    assert "r1" not in wd and wd.sweep() == []


def test_prefill_stage_checks_both_instances():
    wd, clock = make()
    for rid in ("a", "b"):
        wd.track(rid)
    wd.seen("p0")
    wd.seen("d0")
    wd.seen("p1")
    wd.seen("d1")
    wd.accepted("a", "p0", "d0")
    wd.accepted("b", "p1", "d1")
    clock.advance(2.5)
    wd.seen("p0")
    wd.seen("d0")
    wd.seen("p1")  # d1 went silent
    verdicts = wd.sweep()
    assert [(v.request_id, v.code) for v in verdicts] == [("b", ErrorCode.UNAVAILABLE)]
    assert "decode instance d1" in verdicts[0].message
    assert wd.stage("a") == "prefill"


def test_unknown_instance_gets_grace_from_acceptance():
    wd, clock = make()
    wd.track("r")
    clock.advance(5.0)
    wd.accepted("r", "p9", "d9")  # never reported: counted as seen now
    clock.advance(2.0)
    assert wd.sweep() == []
    clock.advance(0.5)
    [v] = wd.sweep()
    assert "prefill instance p9" in v.message


def test_tokens_keep_decode_alive():
    wd, clock = make()
    wd.track("r")
    wd.accepted("r", "p0", "d0")
    for _ in range(5):
        clock.advance(1.5)
        wd.tokens("r")
        assert wd.sweep() == []


def test_idle_timeout_and_untrack():
    wd, clock = make(timeout=10.0)
    wd.track("q")  # never hears anything
    wd.track("done")
    clock.advance(10.0)
    assert wd.sweep() == []
    wd.untrack("done")
    clock.advance(0.1)
    [v] = wd.sweep()
    assert (v.request_id, v.code) == ("q", ErrorCode.TIMEOUT)
    assert len(wd) == 0
    wd.tokens("q")  # events for an untracked request are ignored
    wd.accepted("q", "p", "d")
    assert wd.stage("q") == "untracked"


def test_first_token_from_prefill_keeps_watching_prefill():
    # Prefill streamed the first token but still has to ship the KV and hand it over.
    wd, clock = make()
    wd.seen("p0")
    wd.seen("d0")
    wd.track("r1")
    wd.accepted("r1", "p0", "d0")
    wd.tokens("r1", from_prefill=True)
    assert wd.stage("r1") == "prefill"
    clock.advance(1.5)
    wd.seen("d0")
    clock.advance(1.0)  # p0 silent 2.5 s
    [v] = wd.sweep()
    assert "prefill instance p0" in v.message
    wd.track("r2")
    wd.accepted("r2", "p0", "d0")
    wd.tokens("r2", from_prefill=True)
    wd.tokens("r2")  # decode's tokens: from now on only decode matters
    assert wd.stage("r2") == "decode"
