"""What every bench reports with: nearest-rank percentiles, millisecond summaries, a
process's CPU time, and the figures a result should hold but does not
(:func:`unmeasured`)."""

import fnmatch
import math
import os
import platform
from collections.abc import Iterator


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def machine(cpuinfo: str = "/proc/cpuinfo") -> dict[str, object]:
    """What ran a bench: figures from two machines of the same size differ by up to 2x
    here (a paced bus round trip 0.46-0.66 ms on one, 0.9 ms on another), so a result
    says where it came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def machine_line(m: dict[str, object]) -> str:
    return f"{m['cores']} x {m['cpu']}, kernel {m['kernel']}, Python {m['python']}"


def outcomes(results: list[tuple[str, float]]) -> tuple[list[float], int, dict[str, int]]:
    """Open-loop requests' ``(outcome, seconds to the first token)`` folded into the
    first-token times of the served ("ok"), the 429s (overload answered before
    acceptance, not a failure), and every other outcome by kind."""
    served = [t for kind, t in results if kind == "ok"]
    rejected = sum(1 for kind, _ in results if kind == "429")
    errors: dict[str, int] = {}
    for kind, _ in results:
        if kind not in ("ok", "429"):
            errors[kind] = errors.get(kind, 0) + 1
    return served, rejected, errors


def summary_ms(values_s: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values_s, 50) * 1e3, 3),
        "p90": round(percentile(values_s, 90) * 1e3, 3),
        "p99": round(percentile(values_s, 99) * 1e3, 3),
        "mean": round(sum(values_s) / len(values_s) * 1e3, 3) if values_s else math.nan,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of process ``pid`` so far: how often
    it slept waiting and was woken (0 once it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total


def leaves(obj: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Every leaf of a JSON-like result by its dotted path (list items by index):
    ``{"a": {"b": [1, 2]}}`` -> ("a.b.0", 1), ("a.b.1", 2)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def is_figure(v: object) -> bool:
    """A measured number: an int or float, finite (not NaN, inf, None or a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def unmeasured(result: object, *patterns: str) -> list[str]:
    """What ``result`` should have measured and did not: each leaf a pattern names
    (a dotted path, fnmatch wildcards: ``ttft_ms.*``, ``runs.*.good_per_s``) that is
    not a finite number, as ``path=value``, and each pattern that names no leaf."""
    flat = dict(leaves(result))
    bad = []
    for pat in patterns:
        hits = [k for k in flat if fnmatch.fnmatchcase(k, pat)]
        if not hits:
            bad.append(f"{pat}: absent")
        bad += [f"{k}={flat[k]!r}" for k in hits if not is_figure(flat[k])]
    return bad
