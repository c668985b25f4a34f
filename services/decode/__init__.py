"""Decode instances: ``python -m services.decode --nats URL --instance decode-0 --node d0``.

The worker (:mod:`services.decode.worker`) adapts the bus to an engine
(:mod:`services.engine`), which owns continuous batching."""
