"""A node's KV store: block metadata (:mod:`.block_pool`, the tiers below DRAM in
:mod:`.tiers`), the shared-memory arena (:mod:`.arena`), the data plane
(:mod:`.transfer`: bytes through the transfer engine, coordination over ZeroMQ), the
plain-TCP object endpoint (:mod:`.object_server`), the NATS service (:mod:`.server`, which hands tiering, objects and
replication a :class:`~.core.StoreCore`, not itself) and the worker-side client
(:mod:`.client`)."""
