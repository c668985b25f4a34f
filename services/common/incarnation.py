"""A process's incarnation: drawn once at start, carried by what it reports.

An instance is its incarnation, not its name: a worker or store that restarts under the
same name (``perigee up`` within a second, a Kubernetes container restart) is a new
instance, and whatever the old one held (requests, grants, index entries) died with it.
Incarnations are the start time in nanoseconds, so a later start has the larger one and
a consumer can drop a late message of the dead process (never a smaller incarnation
after a larger). A store's epoch is its incarnation."""

import time


def new_incarnation() -> int:
    return time.time_ns()


# This process's: a worker that switches role in place stays the same incarnation.
_PROCESS = new_incarnation()


def process_incarnation() -> int:
    return _PROCESS


def addressed_elsewhere(addressed: int, mine: int) -> bool:
    """Whether a message addressed to incarnation ``addressed`` (0: any) is not for the
    process whose incarnation is ``mine``."""
    return addressed != 0 and addressed != mine


# What a report of an incarnation is to whoever knows the instance (judge)
SAME = "same"  # the incarnation known (or the first heard, or one side unknown: 0)
RESTARTED = "restarted"  # a newer incarnation: what the old one held is dead
STALE = "stale"  # an older incarnation's message, late: ignore it


def judge(known: int | None, incarnation: int) -> str:
    """What a message of ``incarnation`` says, given the incarnation ``known`` (None:
    the instance was never heard of)."""
    if known is None or incarnation == known or not (incarnation and known):
        return SAME
    return RESTARTED if incarnation > known else STALE
