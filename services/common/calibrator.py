"""A worker's side of online calibration (services.common.calibration is the pure
fitter): one :class:`Calibrator` per instance (one engine, one process) takes what
the engine measured, keeps the instance's :class:`OnlineFit`, observes the
predicted/measured prefill metric, annotates the load reports with the fit and the
fresh measurements, and keeps the fit on disk per model and hardware so the next
start begins calibrated.

Fits on disk: ``$PERIGEE_CACHE_DIR/fits/<model>-<hash>.json`` (default cache dir
``~/.cache/perigee``), the hash over the model's config.json, the CPU model, the
engine (vLLM version, or the mock's speedup) and the GPU when there is one. The
file is the ``perigee-cost-model`` JSON (it also works as ``--cost-model``), written
to a temporary file and renamed.
"""

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from bus_schemas.load import CostFit
from services.common import metrics
from services.common.calibration import OnlineFit
from services.common.cost_fit import FittedCostModel
from services.common.cost_model import CostModel

log = structlog.get_logger()

MAX_REPORTED_STEPS = 32  # decode steps per load report (the latest)
MAX_REPORTED_PREFILLS = 64


# A refit costs about a millisecond of the worker's event loop; at tens of requests (or
# hundreds of decode steps) a second it is done at most this often, except while the
# fit is young (the warm-up and the first requests move it most).
REFIT_INTERVAL_S = 0.5
YOUNG_SAMPLES = 32


class Calibrator:
    """One instance's online calibration: its fit, its fresh measurements and its fit on disk."""

    def __init__(
        self,
        fit: OnlineFit,
        *,
        path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fit = fit
        self.path = path
        self._clock = clock
        self._fitted_at = -math.inf
        self._fitted_on = (-1, -1)  # (prefill, decode) samples behind the cached fit
        self._model: CostModel | None = None
        self._cost_fit: CostFit | None = None
        self._prefills: deque[tuple[int, int, float]] = deque(maxlen=MAX_REPORTED_PREFILLS)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=MAX_REPORTED_STEPS)
        self._from_disk = isinstance(fit.prior, FittedCostModel)

    def model(self) -> CostModel:
        self._refresh()
        assert self._model is not None
        return self._model

    def _refresh(self) -> None:
        f = self.fit
        seen = (f.prefill_samples, f.decode_samples)
        if self._model is not None and seen == self._fitted_on:
            return
        now = self._clock()
        young = min(n for n in seen if n > 0) <= YOUNG_SAMPLES if any(seen) else True
        if self._model is not None and not young and now - self._fitted_at < REFIT_INTERVAL_S:
            return
        self._model = f.model()
        has_p = f.prefill_samples > 0 or self._from_disk
        has_d = f.decode_samples > 0 or self._from_disk
        self._cost_fit = CostFit(
            prefill=list(f.prefill_coef()) if has_p else None,
            decode=list(f.decode_coef()) if has_d else None,
            prefill_samples=f.prefill_samples,
            decode_samples=f.decode_samples,
        )
        self._fitted_at, self._fitted_on = now, seen

    # -- measurements (the worker's prefill, the engine's decode steps) --
    def prefill(self, n: int, p: int, seconds: float, predicted: float | None = None) -> None:
        """A prefill of ``n`` tokens, ``p`` loaded, computed in ``seconds``;
        ``predicted``: what this instance's fit said when the compute started."""
        if predicted is not None and seconds > 0 and n > p:
            metrics.PREFILL_PREDICTED_OVER_MEASURED.observe(predicted / seconds)
        self.fit.add_prefill(n, p, seconds)
        self._prefills.append((n, p, seconds))

    def decode_step(self, batch: int, context: int, seconds: float) -> None:
        self.fit.add_decode(batch, context, seconds)
        self._steps.append((batch, context, seconds))

    # -- reports --
    def cost_fit(self) -> CostFit:
        self._refresh()
        assert self._cost_fit is not None
        return self._cost_fit

    def annotate(self, report: Any) -> Any:
        """``report`` (PrefillLoad / DecodeLoad) with the fit and the measurements
        taken since the previous report."""
        measured = list(self._prefills if hasattr(report, "queued_work_s") else self._steps)
        (self._prefills if hasattr(report, "queued_work_s") else self._steps).clear()
        return msgspec.structs.replace(report, fit=self.cost_fit(), measured=measured)

    # -- disk --
    def save(self) -> None:
        if self.path is None or not (self.fit.prefill_samples or self.fit.decode_samples):
            return
        try:
            model = self.model()
            doc = model.to_json() if isinstance(model, FittedCostModel) else None
            if doc is not None:
                write_atomic(self.path, json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            log.warning("calibration_save_failed", path=str(self.path), error=str(e))


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_dir() -> Path:
    return Path(os.environ.get("PERIGEE_CACHE_DIR") or Path.home() / ".cache" / "perigee")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def engine_key(engine: str, speedup: float) -> str:
    """What besides the model and the CPU decides the engine's speed."""
    if engine == "mock":
        return f"mock-speedup={speedup:g}"
    try:
        from importlib.metadata import version

        v = version("vllm")
    except Exception:  # noqa: BLE001 - not installed: the key still differs by engine
        v = "?"
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    return f"{engine}-{v}-{gpu}"


def fit_path(model_dir: str | Path, model_name: str, engine: str, speedup: float) -> Path:
    try:
        config = (Path(model_dir) / "config.json").read_bytes()
    except OSError:
        config = str(model_dir).encode()
    h = hashlib.sha256()
    for part in (config, cpu_model().encode(), engine_key(engine, speedup).encode()):
        h.update(part + b"\0")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name) or "model"
    return cache_dir() / "fits" / f"{safe}-{h.hexdigest()[:16]}.json"


def load_prior(path: Path | None, default: CostModel) -> CostModel:
    """The fit kept at ``path`` (at ``default``'s speedup), else ``default``."""
    if path is None or not path.exists():
        return default
    try:
        return FittedCostModel.load(path, speedup=default.speedup)
    except (OSError, ValueError, TypeError) as e:
        log.warning("calibration_cache_unreadable", path=str(path), error=str(e))
        return default


def for_worker(
    engine: str, model_dir: str | Path, model_name: str, prior: CostModel, engine_speedup: float
) -> Calibrator:
    """The instance's calibrator: starting from the fit kept on disk for this model,
    machine and engine, else from ``prior``."""
    path = fit_path(model_dir, model_name, engine, engine_speedup)
    start = load_prior(path, prior)
    if start is not prior:
        log.info("calibration_loaded", path=str(path))
    return Calibrator(OnlineFit(start), path=path)
