"""Replica placement for objects (pure): which nodes should hold a key, and what to do.

Rendezvous (highest-random-weight) hashing ranks every live node for a key; the
first ``n`` hold its replicas, so replicas are on distinct nodes, every client
computes the same answer without a master, and a node joining or leaving moves only
the keys it ranks first for. ``plan`` turns "who holds it now" into copies (from a
current holder) and removals.
"""

import hashlib
from dataclasses import dataclass


def _weight(key: str, node: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{node}\0{key}".encode(), digest_size=8).digest(), "big")


def rank(key: str, nodes: list[str]) -> list[str]:
    """Nodes in preference order for ``key`` (ties impossible in practice; name breaks them)."""
    return sorted(set(nodes), key=lambda n: (-_weight(key, n), n))


@dataclass(frozen=True)
class ReplicaPlan:
    """How to make the top ``n`` nodes hold a key: who keeps it, the copies and the removals."""

    keep: list[str]  # nodes that should hold the key, in preference order
    copies: list[tuple[str, str]]  # (source holder, destination)
    removes: list[str]


def plan(key: str, nodes: list[str], holders: set[str], n: int) -> ReplicaPlan:
    """What to do so that exactly the top ``n`` live nodes hold ``key``. With no holder
    nothing can be copied (the plan only removes nothing and copies nothing)."""
    if n < 0:
        raise ValueError("replica count must be >= 0")
    order = rank(key, nodes)
    want = order[:n]
    live_holders = [h for h in order if h in holders]
    copies: list[tuple[str, str]] = []
    if live_holders:
        for i, dst in enumerate(d for d in want if d not in holders):
            copies.append((live_holders[i % len(live_holders)], dst))
    removes = [h for h in order if h in holders and h not in want] if live_holders and n > 0 else []
    if n == 0:
        removes = live_holders
    return ReplicaPlan(keep=want, copies=copies, removes=removes)
