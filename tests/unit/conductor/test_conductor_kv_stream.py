"""The conductor's replay of the KV-event stream (services.common.kv_stream.CatchUp and
ShadowView): history is told from live batches by the consumer's pending count; a
replayed batch fills the index but is no sign that its store is alive, nothing is swept
during the replay, and a node known only from history is dropped one
``store_dead_after_s`` after it unless it shows up live. Manual clock, no bus."""

from bus_schemas.kv_events import BlockStored, EventBatch
from services.common.clock import ManualClock
from services.common.kv_stream import CatchUp, msg_id
from services.conductor.shadow import ShadowView


def batch(node: str, seq: int, *hashes: int, epoch: int = 7) -> EventBatch:
    return EventBatch(
        node=node, epoch=epoch, seq=seq, ts=0.0, events=[BlockStored(block_hashes=list(hashes))]
    )


def test_an_empty_stream_is_caught_up_at_once_and_every_message_is_live():
    c = CatchUp(0)
    assert c.done
    assert c.on_message(0) is False and c.replayed == 0


def test_messages_up_to_the_one_with_nothing_pending_are_history():
    c = CatchUp(3)
    assert [c.on_message(p) for p in (2, 1, 0)] == [True, True, True]
    assert c.done and c.replayed == 3
    assert c.on_message(0) is False  # live from here on
    assert c.replayed == 3


def test_a_message_published_during_the_replay_is_still_history_until_the_end():
    c = CatchUp(2)
    assert c.on_message(2) is True  # one more arrived meanwhile: 2 still behind it
    assert not c.done
    assert c.on_message(1) is True and c.on_message(0) is True and c.done


def test_msg_id_names_node_epoch_and_seq():
    assert msg_id("p0", 12, 3) == "p0.12.3"


def view(clock: ManualClock) -> ShadowView:
    return ShadowView(None, None, clock, store_dead_after_s=5.0)  # type: ignore[arg-type]


def test_replayed_batches_fill_the_index_but_do_not_make_a_store_alive():
    clock = ManualClock(100.0)
    v = view(clock)
    v.apply(batch("p0", 1, 11, 12), live=False)
    assert v.index.blocks("p0") == {11, 12}
    assert v.match([11, 12]) == {}  # no sign of life yet
    v.apply(batch("p0", 2, 13), live=True)
    assert v.match([11, 12, 13]) == {"p0": 3}


def test_nothing_is_swept_before_the_replay_caught_up():
    clock = ManualClock(0.0)
    v = view(clock)
    v.apply(batch("dead", 1, 1), live=False)
    clock.advance(60.0)
    assert v.sweep() == []
    assert v.index.nodes() == ["dead"]


def test_a_node_known_only_from_history_is_dropped_one_dead_after_past_the_replay():
    clock = ManualClock(0.0)
    v = view(clock)
    v.apply(batch("dead", 1, 1), live=False)
    v.apply(batch("p0", 1, 2), live=False)
    v.caught_up.set()
    assert v.sweep() == []  # the grace starts at the first sweep after the replay
    clock.advance(3.0)
    v.apply(batch("p0", 2, 3), live=True)  # p0 is alive
    clock.advance(2.5)
    assert v.sweep() == ["dead"]
    assert v.index.nodes() == ["p0"] and v.match([2, 3]) == {"p0": 2}
    clock.advance(5.0)  # p0 silent for 7.5 s now: gone as any store that stops
    assert v.sweep() == ["p0"]
