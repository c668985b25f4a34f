"""Storage tiers of a node's store: the pure placement policy and the byte stores."""

from services.store.tiers.policy import Move, Tier, TierIndex
from services.store.tiers.pool import TieredBlockPool

__all__ = ["Move", "Tier", "TierIndex", "TieredBlockPool"]
