"""Placeholder secrets refuse to be deployed (issue 23): scripts/check-secrets.sh, run
before ``kubectl kustomize ... | kubectl apply -f -`` (kustomize has no validation step
that could fail the render), exits 1 naming every key of the Secret's env file that is
empty or still a template value, and 0 once each is replaced."""

import re
import secrets
import subprocess
from pathlib import Path

from services.common.placeholders import PLACEHOLDER

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "check-secrets.sh"
CREDENTIALS = ROOT / "deploy" / "k8s" / "base" / "credentials.env"


def check(*files: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *map(str, files)], cwd=cwd, capture_output=True, text=True, timeout=30
    )


def entries(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def filled(tmp_path: Path) -> Path:
    """credentials.env with every placeholder replaced by a secret of its own."""
    out = tmp_path / "credentials.env"
    out.write_text(
        re.sub(
            rf"{PLACEHOLDER}[\w.-]*",
            lambda _: secrets.token_urlsafe(24),
            CREDENTIALS.read_text(),
        )
    )
    return out


def test_the_template_is_refused_naming_every_placeholder(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    placeholders = [k for k, v in entries(CREDENTIALS.read_text()).items() if PLACEHOLDER in v]
    # five NATS passwords, the auth callout's key pair, the API key, the data key
    assert len(placeholders) == 9
    assert "data-key" in placeholders
    for cwd in (ROOT, tmp_path):  # the default file is found from anywhere
        r = check(cwd=cwd)
        assert r.returncode == 1, r.stdout + r.stderr
        named = re.findall(r": ([\w-]+) is still the placeholder", r.stderr)
        assert named == placeholders
        assert "refusing" in r.stderr and "Deploy on Kubernetes" in r.stderr


def test_real_values_pass(tmp_path):
    r = check(filled(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


def test_one_placeholder_left_empty_or_in_another_case_is_refused(tmp_path):
    env = filled(tmp_path)
    good = env.read_text()
    for bad, why in (
        ("api-key=REPLACE-ME-gateway-api-key", "api-key is still the placeholder"),
        ("api-key=replace-me-too", "api-key is still the placeholder"),
        ("store-nats-password=", "store-nats-password is empty"),
        ("data-key=REPLACE-ME-store-data-key", "data-key is still the placeholder"),
        ("data-key=", "data-key is empty"),
        ("just a line", "not KEY=VALUE"),
    ):
        env.write_text(good + bad + "\n")
        r = check(env)
        assert r.returncode == 1 and why in r.stderr, (bad, r.stderr)
    env.write_text(good.rstrip("\n") + "\napi-key=REPLACE-ME")  # no final newline
    assert check(env).returncode == 1
    r = check(filled(tmp_path), tmp_path / "missing.env")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_the_readme_and_the_kustomization_run_it_before_apply():
    readme = (ROOT / "README.md").read_text()
    applies = [line for line in readme.splitlines() if "| kubectl apply -f -" in line]
    assert applies
    for line in applies:
        assert line.startswith("scripts/check-secrets.sh && kubectl kustomize deploy/k8s/"), line
    base = (ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml").read_text()
    assert "scripts/check-secrets.sh && kubectl kustomize" in base
