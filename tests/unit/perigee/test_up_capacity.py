"""A store too small for one maximum-length request is refused before anything starts:
by perigee up (once, with the flag to change) and by each worker (the same rule)."""

import pytest

from perigee.up import parse
from services.common.kv_layout import store_too_small


def test_the_rule_counts_whole_blocks():
    assert store_too_small(256, 8192, 32) == ""  # 8192 / 32 exactly
    assert store_too_small(256, 8193, 32) != ""  # one token more needs a 257th block
    short = store_too_small(10, 8192, 32)
    assert "needs 256" in short and "--capacity-blocks 256" in short


def test_perigee_up_refuses_a_store_too_small_for_the_model(capsys):
    # The tiny model's context is 8,192 tokens: 256 blocks of 32.
    with pytest.raises(SystemExit) as e:
        parse(["--engine", "mock", "--store-capacity-blocks", "255"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--store-capacity-blocks 256" in err and "8192" in err
    assert (
        parse(["--engine", "mock", "--store-capacity-blocks", "256"]).store_capacity_blocks == 256
    )
