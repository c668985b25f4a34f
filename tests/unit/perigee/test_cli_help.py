"""``perigee bench --help`` says what each bench measures; ``python -m services.engine``
explains that the engine is a library the workers load."""

import subprocess
import sys

from perigee.bench import BENCHES
from perigee.cli import main


def test_bench_help_describes_every_bench(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(BENCHES) <= set(rows), out
    for name in BENCHES:
        assert len(rows[name].split()) > 3, rows[name]  # a description, not just the name


def test_engine_module_explains_itself():
    r = subprocess.run(
        [sys.executable, "-m", "services.engine", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "library" in r.stdout
