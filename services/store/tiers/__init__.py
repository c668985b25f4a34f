"""Storage tiers of a node's store: the pure placement policy, the pool's lower-tier
hooks (:mod:`.lower`) and the byte stores (:mod:`.backends`)."""

from services.store.tiers.policy import Move, Tier, TierIndex

__all__ = ["Move", "Tier", "TierIndex"]
