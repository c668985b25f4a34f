"""A node's KV store: block metadata (:mod:`.block_pool`), the shared-memory arena
(:mod:`.arena`), the ZeroMQ data plane (:mod:`.transfer`), the NATS service
(:mod:`.server`) and the worker-side client (:mod:`.client`)."""
