"""The README's runnable examples, run as written against a live stack (issue 23: the
bus example had drifted from what ``perigee up`` does).

A block is runnable when the line before its opening fence (blank lines aside) is
``<!-- test -->``. Each runs in the repository root with the venv on ``PATH`` (as after
``source .venv/bin/activate``), against ``perigee up --engine mock`` serving the tiny
model under the default model's name. Only two strings change: the README's gateway
address ``127.0.0.1:8000`` becomes the test stack's, and its log directory
``.perigee/logs`` the test's, so a user's own stack is never touched. A Python block
runs in a shell that sourced ``<log-dir>/env``, as the README tells the reader to.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from perigee.natsd import free_port
from tests.e2e.up_process import ROOT, UpProcess

README = ROOT / "README.md"
MARKER = "<!-- test -->"
BLOCK_TIMEOUT_S = 120


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, code) of every block marked runnable, in README order."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.fullmatch(r"```(\w+)\s*", line)
        if not m:
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j < 0 or lines[j].strip() != MARKER:
            continue
        end = lines.index("```", i + 1)
        out.append((i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
    return out


BLOCKS = runnable_blocks(README.read_text())


def test_the_readme_marks_its_examples():
    langs = [lang for _, lang, _ in BLOCKS]
    assert set(langs) == {"bash", "python"}, langs  # a typo'd fence would drop a block
    assert len(BLOCKS) >= 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    port = free_port()
    up = UpProcess(
        tmp / "up.out",
        "--port",
        str(port),
        "--log-dir",
        str(tmp / "logs"),
        "--gateway-arg=--served-model-name=SmolLM2-135M-Instruct",
    )
    up.wait_ready()
    yield port, tmp / "logs"
    up.stop()


@pytest.mark.parametrize(
    "line,lang,code", BLOCKS, ids=[f"README.md:{n}-{lang}" for n, lang, _ in BLOCKS]
)
def test_readme_block_runs(stack, line, lang, code):
    port, logs = stack
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(".perigee/logs", str(logs))
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    env["VIRTUAL_ENV"] = str(Path(venv_bin).parent)
    if lang == "bash":
        argv, stdin = ["bash", "-c", "set -euo pipefail\n" + code], None
    else:
        argv, stdin = ["bash", "-c", f"source {logs}/env && exec python -"], code
    r = subprocess.run(
        argv,
        input=stdin,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    out = r.stdout + r.stderr
    print(out)  # shown with -s or on failure
    assert r.returncode == 0, f"README.md:{line} exited {r.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert '"error"' not in r.stdout and "'error'" not in r.stdout, out[-3000:]
