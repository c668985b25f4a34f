"""Conductor: KVCache-centric placement (paper §4.1-4.2, Algorithm 1) and the stores'
transactions (§5.3). Pure pieces: prefix_index.PrefixIndex, policy.PlacementPolicy."""
