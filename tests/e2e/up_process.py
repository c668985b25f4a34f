"""``perigee up`` as a real subprocess (the mock engine: ready in seconds), for the tests
that check what a user of the command sees: its output, its files, its refusals."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 90.0


def perigee_argv() -> list[str]:
    script = Path(sys.executable).parent / "perigee"
    return [str(script)] if script.exists() else [sys.executable, "-m", "perigee.cli"]


class UpProcess:
    """``perigee up --engine mock ARGS`` in a session of its own, output to a file."""

    def __init__(self, out_path: Path, *args: str, cwd: Path = ROOT) -> None:
        self.out_path = out_path
        self._out = open(out_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*perigee_argv(), "up", "--engine", "mock", "--speedup", "100", *args],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Until it prints its ready message; fails with its output if it exits first."""
        end = time.monotonic() + DEADLINE_S
        while "perigee: ready at" not in self.output():
            if self.proc.poll() is not None:
                pytest.fail(f"perigee up exited {self.proc.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > end:
                pytest.fail(f"perigee up not ready in {DEADLINE_S:g} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"perigee up still running:\n{self.output()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM (a clean stop), SIGKILL to the session if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()
        return self.proc.returncode
