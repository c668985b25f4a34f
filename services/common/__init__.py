"""Pure pieces several services share: hashing, clock, cost model, model spec, config.

Nothing here does I/O except the small NATS/logging helpers, which every service
uses the same way."""
