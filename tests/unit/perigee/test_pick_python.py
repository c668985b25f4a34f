"""The Makefile makes its venvs with the distro's optimised CPython 3.11 where there is
one (scripts/pick-python.sh), else python3; ``make PY=...`` still chooses."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PICK = ROOT / "scripts" / "pick-python.sh"


def pick(candidate: str) -> str:
    env = {**os.environ, "DISTRO_PYTHON": candidate}
    return subprocess.run([str(PICK)], env=env, check=True, capture_output=True, text=True).stdout


def test_a_python_3_11_that_can_make_a_venv_is_taken():
    assert pick(sys.executable) == f"{sys.executable}\n"


def test_otherwise_python3(tmp_path: Path):
    assert pick(str(tmp_path / "absent")) == "python3\n"
    no_venv = tmp_path / "python3.11"  # a distro build without its venv package
    no_venv.write_text(
        f'#!/bin/sh\nexec {sys.executable} -c \'import sys; sys.modules["ensurepip"] = None; '
        'exec(sys.argv[1])\' "$2"\n'
    )
    no_venv.chmod(0o755)
    assert pick(str(no_venv)) == "python3\n"


def make_py(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    show = tmp_path / "show.mk"
    show.write_text(f"include {ROOT / 'Makefile'}\n.DEFAULT_GOAL := show\nshow: ; @echo $(PY)\n")
    out = subprocess.run(
        ["make", "-s", "-f", str(show), *args],
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != "PY"}, **(env or {})},
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def test_the_makefile_takes_the_pick_unless_told(tmp_path: Path):
    env = {"DISTRO_PYTHON": sys.executable}
    assert make_py(tmp_path, env=env) == sys.executable
    assert make_py(tmp_path, "PY=python3", env=env) == "python3"
    assert make_py(tmp_path, env={**env, "PY": "python3"}) == "python3"
