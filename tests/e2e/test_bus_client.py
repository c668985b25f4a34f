"""The README's bus-client example, run verbatim against a live stack."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_bus_example() -> str:
    text = README.read_text()
    section = text.split("## Talking to the bus directly", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_bus_client_runs_as_written(stack):
    code = readme_bus_example()
    assert 'os.environ["PERIGEE_NATS_URL"]' in code  # what `source <log-dir>/env` sets
    env = {**os.environ, "PERIGEE_NATS_URL": stack.nats_url}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    events = [ast.literal_eval(ln) for ln in out.stdout.strip().splitlines()]
    assert events[0]["type"] == "accepted"
    tokens = [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]
    assert len(tokens) == 8
    assert events[-1]["type"] == "finished" and events[-1]["completion_tokens"] == 8
