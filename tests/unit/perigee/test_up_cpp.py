"""perigee up's chunked pipeline parallelism flags reach the conductors, on the mock
engine only (a vLLM anchor would compute the whole prompt again after the stages)."""

import pytest

from perigee.stack import Stack
from perigee.up import parse


def test_cpp_flags_reach_every_conductor():
    cfg = parse(
        ["--engine", "mock", "--conductors", "2", "--cpp-group", "2", "--cpp-min-tokens", "2048"]
    )
    conductors = [c.argv for c in Stack(cfg).plan() if c.name.startswith("conductor")]
    assert len(conductors) == 2
    for argv in conductors:
        assert argv[-4:] == ["--cpp-group", "2", "--cpp-min-tokens", "2048"]
    plain = parse(["--engine", "mock"])
    assert not any("--cpp-group" in c.argv for c in Stack(plain).plan())


def test_cpp_groups_are_refused_on_vllm():
    with pytest.raises(SystemExit):
        parse(["--engine", "vllm", "--cpp-group", "2"])
