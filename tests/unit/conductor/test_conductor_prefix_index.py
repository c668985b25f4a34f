"""Shadow prefix index: exact match lengths, sequence gaps, epochs, removal."""

from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from services.conductor import prefix_index
from services.conductor.prefix_index import Matches, NodeGroup, NodeWeights, PrefixIndex

E1, E2 = 1_000, 2_000


def batch(node: str, seq: int, *events, epoch: int = E1) -> EventBatch:
    return EventBatch(node=node, epoch=epoch, seq=seq, ts=0.0, events=list(events))


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes))


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes))


def make_index() -> PrefixIndex:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 1, stored(1, 2, 3, 4))) is False
    assert idx.apply(batch("b", 1, stored(1, 2))) is False
    assert idx.apply(batch("c", 1, stored(2, 3))) is False  # not a prefix: no block 1
    return idx


def test_match_lengths_per_node():
    idx = make_index()
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert idx.match([1, 2]) == {"a": 2, "b": 2}
    assert idx.match([1, 9, 3]) == {"a": 1, "b": 1}
    assert idx.match([2, 3]) == {"a": 2, "b": 1, "c": 2}
    assert idx.match([7]) == {}
    assert idx.match([]) == {}
    assert idx.state("a") == (E1, 1)
    assert idx.num_blocks() == 4


def test_in_sequence_batches_and_duplicates():
    idx = make_index()
    assert idx.apply(batch("b", 2, stored(3))) is False
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 3}
    assert idx.apply(batch("b", 2, removed(3))) is False  # duplicate seq: ignored
    assert idx.match([1, 2, 3]) == {"a": 3, "b": 3}
    assert idx.state("b") == (E1, 2)


def test_removal_and_clear():
    idx = make_index()
    assert idx.apply(batch("a", 2, removed(3))) is False
    assert idx.match([1, 2, 3, 4]) == {"a": 2, "b": 2}
    assert idx.apply(batch("b", 2, AllBlocksCleared())) is False
    assert idx.match([1, 2, 3, 4]) == {"a": 2}
    assert idx.blocks("b") == frozenset()
    idx.remove_node("a")
    assert idx.match([1, 2]) == {}
    assert idx.match([2, 3]) == {"c": 2}
    assert idx.num_blocks() == 2  # only c's blocks 2 and 3 remain
    # A node added later reuses the freed bit without inheriting a's blocks.
    assert idx.apply(batch("d", 1, stored(9))) is False
    assert idx.match([1, 2]) == {}
    assert idx.match([9]) == {"d": 1}


def test_gap_asks_for_dump_once_and_dump_replays_newer_batches():
    idx = make_index()
    assert idx.apply(batch("b", 3, stored(3))) is True  # seq 2 lost
    assert idx.resyncing("b")
    assert idx.apply(batch("b", 4, stored(4))) is False  # already resyncing: no second dump
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 4}  # best effort meanwhile
    # The dump was taken at seq 3 (it contains the lost seq-2 removal of block 2).
    assert idx.replace_node("b", E1, 3, [1, 3]) is False
    assert not idx.resyncing("b")
    assert idx.state("b") == (E1, 4)  # batch 4 replayed on top of the snapshot
    assert idx.blocks("b") == frozenset({1, 3, 4})
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 1}
    assert idx.apply(batch("b", 5, stored(2))) is False
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 4}


def test_unknown_node_mid_stream_needs_dump():
    idx = PrefixIndex()
    assert idx.apply(batch("x", 7, stored(1))) is True
    assert idx.match([1]) == {"x": 1}
    assert idx.replace_node("x", E1, 8, [1, 2]) is False
    assert idx.state("x") == (E1, 8)
    assert idx.match([1, 2]) == {"x": 2}


def test_gap_left_in_buffer_asks_again():
    idx = make_index()
    idx.begin_resync("a")
    assert idx.apply(batch("a", 2, stored(5))) is False
    assert idx.apply(batch("a", 4, stored(6))) is False
    # The dump at seq 1 is followed by 2 and then 4: seq 3 is missing.
    assert idx.replace_node("a", E1, 1, [1, 2, 3, 4]) is True
    assert idx.resyncing("a")
    assert idx.state("a") == (E1, 2)


def test_dump_failed_makes_next_batch_ask_again():
    idx = make_index()
    assert idx.apply(batch("a", 3)) is True
    idx.dump_failed("a")
    assert not idx.resyncing("a")
    assert idx.apply(batch("a", 4)) is True


def test_new_epoch_clears_node():
    idx = make_index()
    # Restarted store, first batch of its new life: clear and apply, no dump needed.
    assert idx.apply(batch("a", 1, stored(1), epoch=E2)) is False
    assert idx.state("a") == (E2, 1)
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    # A late batch from the old incarnation is ignored.
    assert idx.apply(batch("a", 2, stored(2, 3, 4), epoch=E1)) is False
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    # A newer epoch seen mid-stream: clear, and ask for a dump.
    assert idx.apply(batch("b", 5, stored(8), epoch=E2)) is True
    assert idx.blocks("b") == frozenset({8})
    assert idx.replace_node("b", E2, 5, [1, 2, 8]) is False
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}


def test_stale_dump_is_ignored():
    idx = make_index()
    assert idx.apply(batch("a", 1, stored(1), epoch=E2)) is False
    assert idx.replace_node("a", E1, 9, [1, 2, 3]) is False
    assert idx.state("a") == (E2, 1)
    assert idx.blocks("a") == frozenset({1})


def test_restart_during_dump_asks_again():
    idx = make_index()
    idx.begin_resync("a")
    assert idx.apply(batch("a", 1, stored(7), epoch=E2)) is False
    assert idx.replace_node("a", E1, 1, [1, 2]) is True  # the dump predates the restart
    assert idx.resyncing("a")
    assert idx.replace_node("a", E2, 1, [7]) is False
    assert idx.blocks("a") == frozenset({7})


def brute_match(held: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    out = {}
    for node, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            out[node] = n
    return out


ops = st.lists(
    st.tuples(st.sampled_from("abcd"), st.booleans(), st.lists(st.integers(0, 7), max_size=4)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, query=st.lists(st.integers(0, 7), max_size=8))
def test_match_agrees_with_brute_force(ops, query):
    idx = PrefixIndex()
    held: dict[str, set[int]] = {}
    seq: dict[str, int] = {}
    for node, add, hashes in ops:
        seq[node] = seq.get(node, 0) + 1
        ev = stored(*hashes) if add else removed(*hashes)
        assert idx.apply(batch(node, seq[node], ev)) is False
        s = held.setdefault(node, set())
        s.update(hashes) if add else s.difference_update(hashes)
    assert idx.match(query) == brute_match(held, query)
    assert_grouped(idx.match(query))


def assert_groups_answer_as_lists(m, held: dict[str, set[int]]) -> None:
    """Every group, a NodeGroup or not, answers the placement's questions (least name
    outside a few, instances on its nodes, membership, each node's length) as the list
    of its names does."""
    instances = {n: {f"{n}-p{k}" for k in range(i % 3)} for i, n in enumerate(sorted(held))}
    weights = NodeWeights()
    for length, group in m.by_length.items():
        names = sorted(group)
        for skip in (set(), set(names[:1]), set(names[::2]), set(names)):
            want = min(set(names) - skip, default=None)
            if isinstance(group, NodeGroup):
                assert group.least(skip) == want
                assert group.weigh(instances, weights) == sum(
                    len(instances.get(n, ())) for n in names
                )
        assert len(group) == len(names)
        for node in held:
            assert (node in group) == (node in names)
            assert m.get(node) == (length if node in names else m.get(node))
    for node in held:
        assert m.get(node, 0) == dict(m.items()).get(node, 0)


def assert_grouped(m) -> None:
    """``by_length`` holds exactly the dict's nodes, each under its own length."""
    grouped = [(node, n) for n, nodes in m.by_length.items() for node in nodes]
    assert sorted(grouped) == sorted(m.items())
    assert all(m.by_length.values())


NODES = [f"n{i}" for i in range(24)]  # more than prefix_index.SMALL holders per block
node_ops = st.lists(
    st.tuples(
        st.sampled_from(("stored", "removed", "cleared", "restart", "dump", "remove_node")),
        st.sampled_from(NODES),
        st.lists(st.integers(0, 9), max_size=10),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=node_ops,
    queries=st.lists(st.lists(st.integers(0, 10), max_size=10), min_size=1, max_size=6),
    small=st.sampled_from((2, 3, prefix_index.SMALL)),
)
def test_holders_index_agrees_with_exhaustive_on_random_clusters(ops, queries, small):
    """Issue 27: the per-block holder lists (int, tuple or set as the holders grow and
    shrink; ``small`` low so that sets arise often) give every node's exact prefix, as a
    walk over every node's blocks does, through stores, removals, clears, restarts,
    dumps and forgotten nodes."""
    with patch.object(prefix_index, "SMALL", small):
        check_against_exhaustive(ops, queries)


def check_against_exhaustive(ops, queries):
    idx = PrefixIndex()
    held: dict[str, set[int]] = {}
    seq: dict[str, int] = {}
    epoch: dict[str, int] = {}
    for op, node, hashes in ops:
        if op == "remove_node":
            idx.remove_node(node)
            held.pop(node, None)
            seq.pop(node, None)
            epoch.pop(node, None)
            continue
        if op == "restart":  # a new incarnation's first batch
            epoch[node] = epoch.get(node, E1) + 1
            seq[node] = 1
            assert idx.apply(batch(node, 1, stored(*hashes), epoch=epoch[node])) is False
            held[node] = set(hashes)
            continue
        if op == "dump":
            epoch.setdefault(node, E1)
            seq[node] = seq.get(node, 0) + 5
            idx.begin_resync(node)
            assert idx.replace_node(node, epoch[node], seq[node], hashes) is False
            held[node] = set(hashes)
            continue
        seq[node] = seq.get(node, 0) + 1
        ev = {"stored": stored(*hashes), "removed": removed(*hashes)}.get(op, AllBlocksCleared())
        assert idx.apply(batch(node, seq[node], ev, epoch=epoch.setdefault(node, E1))) is False
        s = held.setdefault(node, set())
        if op == "stored":
            s.update(hashes)
        elif op == "removed":
            s.difference_update(hashes)
        else:
            s.clear()
    for q in queries:
        assert idx.match(q) == brute_match(held, q)
        assert idx.match(sorted(set(q))) == brute_match(held, sorted(set(q)))
        assert_grouped(idx.match(q))
        assert_groups_answer_as_lists(idx.match(q), held)
    everything = set().union(*held.values()) if held else set()
    assert idx.num_blocks() == len(everything)
    for h in range(11):
        assert idx.holders(h) == {n for n, b in held.items() if h in b}


def test_match_groups_the_nodes_by_length():
    """Exact: 30 nodes hold block 1, 20 of them blocks 1-2, 5 of those 1-3: three
    groups, every node under the length it matches (the placement reads the groups)."""
    idx = PrefixIndex()
    for i in range(30):
        blocks = (1, 2, 3) if i < 5 else (1, 2) if i < 20 else (1,)
        assert idx.apply(batch(f"n{i}", 1, stored(*blocks))) is False
    m = idx.match([1, 2, 3, 4])
    assert {n: sorted(v) for n, v in m.by_length.items()} == {
        1: sorted(f"n{i}" for i in range(20, 30)),
        2: sorted(f"n{i}" for i in range(5, 20)),
        3: sorted(f"n{i}" for i in range(5)),
    }
    assert m == {f"n{i}": 3 if i < 5 else 2 if i < 20 else 1 for i in range(30)}
    assert Matches.of({"a": 2, "b": 0, "c": 2}).by_length == {2: ["a", "c"]}


def test_a_prefix_most_nodes_hold_is_one_group_not_a_list_of_names():
    """Exact: 30 nodes hold blocks 1-2 (beyond SMALL holders), 3 of them block 3 too.
    The 27 that stop at 2 are the block's holders less the 3: a NodeGroup, whose least
    node outside a few, instances on its nodes and members are those of the 27 names."""
    idx = PrefixIndex()
    for i in range(30):
        blocks = (1, 2, 3) if i < 3 else (1, 2)
        assert idx.apply(batch(f"n{i:02d}", 1, stored(*blocks))) is False
    m = idx.match([1, 2, 3])
    group = m.by_length[2]
    assert isinstance(group, NodeGroup)
    assert sorted(group) == [f"n{i:02d}" for i in range(3, 30)] and len(group) == 27
    assert sorted(m.by_length[3]) == ["n00", "n01", "n02"]
    assert group.least() == "n03"
    assert group.least({"n03", "n04", "n00"}) == "n05"
    assert group.least(set(group)) is None
    assert "n00" not in group and "n03" in group and "x" not in group
    assert m.get("n00") == 3 and m.get("n29") == 2 and m.get("x") is None and "x" not in m
    assert m == {f"n{i:02d}": 3 if i < 3 else 2 for i in range(30)}
    # Stores down: n00 (of the 3-block list), n05 (of the group), zz (unknown).
    less = m.without({"n00", "n05", "zz"})
    assert less == {f"n{i:02d}": 3 if i < 3 else 2 for i in range(30) if i not in (0, 5)}
    assert "n05" not in less.by_length[2] and len(less.by_length[2]) == 26
    assert m.without({"zz"}) is m and m.without(set()) is m
    # n03 runs two prefill instances, n04 one, n00 (not in the group) one, n05 none.
    per_node = {"n03": {"a", "b"}, "n04": {"c"}, "n00": {"d"}, "n05": set()}
    weights = NodeWeights()
    assert group.weigh(per_node, weights) == 3
    per_node["n06"] = {"e"}
    weights.changed()
    assert group.weigh(per_node, weights) == 4


def test_a_node_group_stays_what_the_match_saw():
    """A NodeGroup is made of the holders as they were: a block stored or removed later
    makes new holders, it does not change a group already handed out."""
    idx = PrefixIndex()
    for i in range(12):
        assert idx.apply(batch(f"n{i:02d}", 1, stored(1))) is False
    group = idx.match([1]).by_length[1]
    assert isinstance(group, NodeGroup) and len(group) == 12
    assert idx.apply(batch("n12", 1, stored(1))) is False
    assert idx.apply(batch("n00", 2, removed(1))) is False
    assert sorted(group) == [f"n{i:02d}" for i in range(12)]
    assert sorted(idx.match([1]).by_length[1]) == [f"n{i:02d}" for i in range(1, 13)]


def test_one_weights_reads_each_index_by_its_own_ids():
    # A placement's weights kept across prefix indexes (a conductor's shadow view
    # rebuilt): each new index numbers the nodes its own way, and may get a freed index's
    # id() and the same ids_version. Found by test_pruned_search as a "no live prefill
    # instance" the full scan did not give, about once in two runs of one example.
    weights = NodeWeights()
    instances = {n: [f"{n}-p"] for n in NODES[:3]}
    for k in range(200):  # each index freed before the next: ids get reused
        idx = make_index()
        order = NODES[k % len(NODES) :] + NODES[: k % len(NODES)]  # ids in another order
        holders = set(order[:12])  # more than SMALL: a NodeGroup
        for node in order:  # every node gets an id; the first twelve hold block 1
            idx.apply(batch(node, 1, stored(1 if node in holders else 2)))
        [group] = idx.match((1,)).by_length.values()
        assert isinstance(group, NodeGroup)
        assert group.weigh(instances, weights) == len(holders & set(instances)), k
        del group, idx  # freed: the next index may take its id()
