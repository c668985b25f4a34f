"""services.common.reservation: the one copy of the reservation arithmetic that the
live prefill instance and the simulator both run."""

import pytest

from bus_schemas.control import TxRole
from bus_schemas.placement import PrefixSource
from services.common import reservation as plan

SRC = PrefixSource(node="n9", first_block=1, num_blocks=3)  # holder has blocks [0, 4)


def test_jobs_lock_the_holders_whole_prefix_and_cap_its_tokens():
    j = plan.jobs(
        prefill_node="p",
        decode_node="d",
        source=SRC,
        block_hashes=[1, 2, 3, 4, 5],
        num_tokens=70,
        block_size=16,
        roles=plan.wanted(SRC),
    )
    assert {r: (x.node, x.role, x.block_hashes, x.num_tokens) for r, x in j.items()} == {
        "prefill": ("p", TxRole.PREFILL, [1, 2, 3, 4, 5], 70),
        "decode": ("d", TxRole.DECODE, [1, 2, 3, 4, 5], 70),
        "source": ("n9", TxRole.SOURCE, [1, 2, 3, 4], 64),
    }
    only = plan.jobs(
        prefill_node="p",
        decode_node="d",
        source=SRC,
        block_hashes=[1],
        num_tokens=20,
        block_size=16,
        roles={"decode"},
    )
    assert list(only) == ["decode"]
    assert plan.wanted(None) == {"prefill", "decode"}


@pytest.mark.parametrize(
    ("refused", "failed", "step", "drop"),
    [
        ({}, {}, plan.ReservationStep.DONE, False),
        ({"source": "missing"}, {}, plan.ReservationStep.DONE, True),
        ({}, {"source": "timeout"}, plan.ReservationStep.DONE, True),
        ({"decode": "capacity"}, {}, plan.ReservationStep.WAIT, False),
        ({"decode": "capacity", "source": "capacity"}, {}, plan.ReservationStep.WAIT, True),
        ({"prefill": "bad_request"}, {}, plan.ReservationStep.FAIL, False),
        ({"prefill": "capacity"}, {"decode": "timeout"}, plan.ReservationStep.FAIL, False),
    ],
)
def test_next_step(refused, failed, step, drop):
    v = plan.next_step(refused, failed)
    assert (v.step, v.drop_source) == (step, drop)


def test_grant_trims_the_pull_to_what_the_prefill_node_lacks():
    g = plan.grant(SRC, prefill_hit=2, decode_hit=1, source_granted=True)
    assert (g.prefix_blocks, g.pull, g.keep_source) == (4, (2, 2), True)
    assert g.pulled_tokens(70, 16) == 32 and g.prefix_tokens(70, 16) == 64
    assert g.ship_tokens(70, 16) == 54
    short = plan.grant(SRC, prefill_hit=2, source_granted=True)
    assert short.pulled_tokens(40, 16) == 8  # the prompt ends inside the pulled blocks


def test_grant_without_a_pull():
    have_all = plan.grant(SRC, prefill_hit=5, source_granted=True)
    assert (have_all.prefix_blocks, have_all.pull, have_all.keep_source) == (5, None, False)
    dropped = plan.grant(SRC, prefill_hit=1, source_granted=False)
    assert (dropped.prefix_blocks, dropped.pulled_tokens(70, 16)) == (1, 0)


def test_expected_prefix():
    assert plan.expected_prefix_blocks(1, SRC) == 4
    assert plan.expected_prefix_blocks(2, None) == 2
    with pytest.raises(plan.BadPrefix):
        plan.expected_prefix_blocks(0, SRC)
