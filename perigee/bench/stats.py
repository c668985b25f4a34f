import math


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values_s, 50) * 1e3, 3),
        "p90": round(percentile(values_s, 90) * 1e3, 3),
        "p99": round(percentile(values_s, 99) * 1e3, 3),
        "mean": round(sum(values_s) / len(values_s) * 1e3, 3) if values_s else math.nan,
    }
