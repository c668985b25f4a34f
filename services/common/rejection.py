"""What every policy answers when a request cannot go on: admission at the door, the
conductor at placement, a decode instance taking over a prefilled request."""

from dataclasses import dataclass

from bus_schemas.requests import ErrorCode


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused, with the error code and Retry-After it gets."""

    code: ErrorCode  # REJECTED (429, with Retry-After) or UNAVAILABLE (503)
    reason: str
    retry_after_s: float | None = None


def slo_share(value: float, slo: float) -> float:
    """``value`` as a share of ``slo``: above 1 misses it (an SLO of 0 only admits 0)."""
    if slo <= 0:
        return 0.0 if value <= 0 else float("inf")
    return value / slo


def idle_capped(share: float, idle: bool, max_load: float) -> float:
    """An idle decode instance's share, capped at ``max_load``: a request alone on it
    gets the best TBT it can ever get, so turning it away helps nobody (and a cost
    model that predicts too slow would never see a sample to correct it)."""
    return min(share, max_load) if idle else share
