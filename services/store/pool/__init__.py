"""A store's metadata (no sockets, no bytes): the block pool and its transactions
(:mod:`.block_pool`), eviction order (:mod:`.eviction`), the tiers' placement policy and
the pool's lower-tier hooks (:mod:`.tier_policy`, :mod:`.lower_tiers`), replica ranking
for objects (:mod:`.replicas`) and the registry of the stores one store knows
(:mod:`.registry`)."""
