"""A node's KV store, in three parts over the transfer engine (:mod:`services.transfer`):
the metadata (:mod:`.pool`: block pool, eviction, tiers' policy, replicas, registry),
the store process (:mod:`.node`: the NATS service, data plane, objects, replication,
tiering) and the clients (:mod:`.client`: the worker's handle, the object API). The
shared-memory arena (:mod:`.arena`) is the store's and its clients' alike."""
