"""Every service flag the README names is usable as it shows it: each ``--<kind>-arg=FLAG``
example parses with ``perigee up``'s parser and with that service's own, and each flag
the README attributes to a single service appears in such an example or in the list
that says where it goes."""

import importlib
import re
from pathlib import Path

import pytest

from perigee.up import SERVICE_KINDS, parse

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()
PASS_THROUGH = re.findall(
    r"--(" + "|".join(SERVICE_KINDS) + r")-arg=(--[\w-]+(?:=[^\s`\\]+)?)", README
)
SERVICE_FLAGS = [
    "--calibration-warmup",
    "--lease",
    "--ttft-margin",
    "--no-serve-when-idle",
    "--intake-ack-wait",
    "--dead-after",
    "--durable-intake",
]


def test_the_readme_shows_pass_through_examples():
    assert len(PASS_THROUGH) >= 3, PASS_THROUGH


@pytest.mark.parametrize("kind,flag", PASS_THROUGH)
def test_each_example_parses(kind, flag):
    cfg = parse(["--engine", "mock", f"--{kind}-arg={flag}"])
    assert cfg.service_args == {kind: [flag]}
    service = importlib.import_module(f"services.{kind}.__main__")
    service.parse_args(flag.split("=", 1))


# Where the README's list says each flag goes (services that accept it).
WHERE = {
    "--calibration-warmup": ("prefill", "decode"),
    "--lease": ("prefill", "decode"),
    "--ttft-margin": ("conductor",),
    "--no-serve-when-idle": ("conductor",),
    "--intake-ack-wait": ("admission", "conductor"),
    "--dead-after": ("gateway", "admission", "conductor"),
    "--durable-intake": ("gateway", "admission", "conductor"),
}
VALUES = {"--calibration-warmup": "3", "--lease": "10", "--ttft-margin": "0.8"}
VALUES |= {"--intake-ack-wait": "2", "--dead-after": "3"}


@pytest.mark.parametrize("flag", SERVICE_FLAGS)
def test_each_documented_service_flag_is_accepted_where_the_readme_says(flag):
    assert f"`{flag}" in README
    for kind in WHERE[flag]:
        service = importlib.import_module(f"services.{kind}.__main__")
        service.parse_args([flag, VALUES[flag]] if flag in VALUES else [flag])
